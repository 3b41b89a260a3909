"""`mlxq serve --tensor-parallel N` on one host: start N ranks, watch them, end together.

This process serves nothing itself: it starts ``N`` copies of the same command
as ranks (what ``mlx.launch`` does: ``MLX_RANK`` and the backend's variables,
ring over loopback on the CPU, NCCL with one GPU per rank on CUDA) and stays
as their supervisor:

- SIGINT/SIGTERM go to rank 0 only, which stops its HTTP side gracefully and
  then tells the other ranks to stop (engine/lockstep.py);
- a rank that exits before rank 0 is a failure: rank 0 is told which one
  through a pipe (it fails its open requests, /health names the rank, it
  exits 1), and this process exits 1;
- the ranks die with this process (Linux: the parent-death signal).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from mlxq.distributed.world import BACKEND_ENV, SUPERVISOR_FD_ENV

FOLLOWERS_GRACE_S = 15.0  # after rank 0 exits: how long the others get to stop before they are killed
FAILED_GRACE_S = 2.0  # the same after rank 0 failed


@dataclass(frozen=True)
class RankLaunch:
    rank: int
    env: dict[str, str]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_backend(requested: str) -> str:
    """auto: NCCL where MLX runs on CUDA, else ring (TCP over loopback)."""
    if requested not in ("auto", "any"):
        return requested
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"


def _cpu_threads(size: int) -> dict[str, str]:
    """Ranks on one CPU share its cores: BLAS threads per rank = cores / ranks (unless set already).

    Measured on 2 cores, 2 ranks: with MKL's default threads (which spin-wait after each call) the
    ranks starve each other in every all_sum: a 4-request burst took 12.7 s, 0.2 s with one thread each."""
    threads = str(max(1, (os.cpu_count() or 1) // size))
    return {name: os.environ.get(name, threads) for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                                              "OPENBLAS_NUM_THREADS")}


def plan_ranks(size: int, backend: str, hostfile_dir: str) -> list[RankLaunch]:
    """Each rank's environment, as mlx.launch would set it for one host."""
    common = {BACKEND_ENV: backend, "MLX_WORLD_SIZE": str(size)}
    if backend == "ring":
        common.update(_cpu_threads(size))
        path = os.path.join(hostfile_dir, "hosts.json")
        with open(path, "w") as f:
            json.dump([[f"127.0.0.1:{_free_port()}"] for _ in range(size)], f)
        common["MLX_HOSTFILE"] = path
    elif backend == "nccl":
        common.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_port()))
    else:
        raise ValueError(f"--distributed-backend {backend}: mlxq starts local ranks over ring or nccl; "
                         "start other backends with mlx.launch")
    visible = _visible_gpus() if backend == "nccl" else []
    if backend == "nccl" and visible and len(visible) < size:
        raise ValueError(f"{size} ranks need {size} GPUs, one each; {len(visible)} visible "
                         "(CUDA_VISIBLE_DEVICES, nvidia-smi -L)")
    launches = []
    for rank in range(size):
        env = {**common, "MLX_RANK": str(rank)}
        if backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = visible[rank] if visible else str(rank)
        launches.append(RankLaunch(rank, env))
    return launches


def _visible_gpus() -> list[str]:
    """The GPUs the ranks may take: CUDA_VISIBLE_DEVICES when set, else those nvidia-smi lists ([] unknown)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(found.splitlines()) if line.startswith("GPU ")]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def describe_exit(rank: int, proc: subprocess.Popen) -> str:
    code = proc.returncode
    how = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"code {code}"
    return f"rank {rank} (pid {proc.pid}) exited with {how}"


def run_local_ranks(argv: list[str], size: int, backend: str) -> int:
    """Start ``size`` ranks of ``mlxq <argv>`` and supervise them; the exit code to end with."""
    backend = choose_backend(backend)
    with tempfile.TemporaryDirectory(prefix="mlxq-ranks-") as scratch:
        launches = plan_ranks(size, backend, scratch)
        notice_read, notice_write = os.pipe()
        procs = []
        for launch in launches:
            env = {**os.environ, **launch.env}
            fds = ()
            if launch.rank == 0:
                env[SUPERVISOR_FD_ENV] = str(notice_read)
                fds = (notice_read,)
            procs.append(subprocess.Popen([sys.executable, "-m", "mlxq.cli.main", *argv], env=env, pass_fds=fds,
                                          start_new_session=True, preexec_fn=_die_with_parent))
        os.close(notice_read)
        return _supervise(procs, notice_write)


def _supervise(procs: list[subprocess.Popen], notice_write: int) -> int:
    def forward(signum, frame):  # to rank 0 only: it stops the others in order
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    failed = None
    while procs[0].poll() is None:
        for rank, proc in enumerate(procs[1:], start=1):
            if failed is None and proc.poll() is not None and proc.returncode != 0:
                failed = describe_exit(rank, proc)
                print(f"mlxq: {failed}", file=sys.stderr, flush=True)
                try:
                    os.write(notice_write, (failed + "\n").encode())
                except OSError:  # rank 0 already gone
                    pass
        time.sleep(0.1)
    # After a clean stop rank 0 has told the others to stop; after a failure they cannot finish anything.
    deadline = time.monotonic() + (FOLLOWERS_GRACE_S if procs[0].returncode == 0 else FAILED_GRACE_S)
    for proc in procs[1:]:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    codes = [code if code >= 0 else 128 - code for code in (proc.returncode for proc in procs)]
    if failed is not None or any(code != 0 for code in codes[1:]):
        return codes[0] or 1
    return codes[0]
