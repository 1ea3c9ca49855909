"""Memory: what the machine has left (the memory guard) and what MLX keeps freed."""
