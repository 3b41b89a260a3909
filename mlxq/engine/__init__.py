"""The engine: the one thread that owns MLX, its lanes and its boundary types."""
