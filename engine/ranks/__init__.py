"""One model over several processes (MLX's distributed layer): ranks, pipeline parts, their sessions."""
