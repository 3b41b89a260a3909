"""mlxq: serve MLX language models with continuous batching and a tiered KV cache."""

# Before anything imports mlx: put an optimized BLAS in front of the
# reference one the Linux CPU wheel links (see mlxq/blas.py).
from mlxq import blas as _blas
from mlxq import fd_limit as _fd_limit  # noqa: F401  (records the open-file limit before mlx-lm lowers it)

_blas.activate()

__version__ = "0.1.0"
