"""GGUF files onto MLX models: reading, checking, converting tensors, the architectures, the memory estimate."""
