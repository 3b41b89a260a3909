"""Which rank this process is, of how many, over which backend.

A rank learns its place from the environment ``mlx.launch`` (or mlxq's own
launcher, distributed/launch.py) sets: ``MLX_RANK`` plus the backend's own
variables (``MLX_HOSTFILE`` for ring, ``NCCL_HOST_IP``/``NCCL_PORT`` for NCCL...).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "any", "ring", "nccl", "jaccl", "mpi")
BACKEND_ENV = "MLXQ_DISTRIBUTED_BACKEND"  # set by the local launcher for its ranks
SUPERVISOR_FD_ENV = "MLXQ_SUPERVISOR_FD"  # rank 0 under the local launcher: where rank failures are reported


@dataclass(frozen=True)
class RankInfo:
    """One rank as /stats.distributed shows it."""

    rank: int
    host: str
    pid: int
    device: str  # MLX's default device, plus CUDA_VISIBLE_DEVICES when set


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    backend: str
    group: Any  # mx.distributed.Group
    mode: str = "tensor"  # tensor: every layer split over the ranks; pipeline: each rank runs some layers

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def local_info(self) -> RankInfo:
        import mlx.core as mx

        device = str(mx.default_device())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            device += f" (CUDA_VISIBLE_DEVICES={visible})"
        return RankInfo(self.rank, socket.gethostname(), os.getpid(), device)


def launched_as_rank() -> bool:
    """This process was started as one rank of a group (mlx.launch or mlxq's launcher)."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def join_world(size: int, backend: str, mode: str = "tensor") -> World:
    """Join the group; refuse a world whose size is not ``size`` (--tensor-parallel / --pipeline-parallel)."""
    import mlx.core as mx

    chosen = os.environ.get(BACKEND_ENV) or ("any" if backend == "auto" else backend)
    try:
        group = mx.distributed.init(strict=True, backend=chosen)
    except Exception as exc:  # mlx raises RuntimeError / ValueError with its own reason
        raise ValueError(f"cannot join the distributed group (backend {chosen}): {exc}") from None
    if group.size() != size:
        raise ValueError(f"--{mode}-parallel {size} but the launcher started {group.size()} ranks; "
                         "pass the same number to both")
    return World(group.rank(), group.size(), chosen, group, mode)
