"""One rank of a tensor-parallel server: joining, loading a shard, following, and failing loudly.

Rank 0 runs the HTTP server around a lockstep engine (engine/lockstep.py);
every other rank runs the same engine with no HTTP side (``run_follower``).
``watch_ranks`` turns a lost rank into errors for the open requests, a /health
that names the rank and an exit with code 1, instead of clients waiting on a
collective that never completes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import select
import threading
import time

from mlxq import __version__
from mlxq.distributed.shard import pipeline_model, shard_model
from mlxq.distributed.world import SUPERVISOR_FD_ENV, join_world
from mlxq.engine.engine import Engine, EngineConfig
from mlxq.engine.lockstep import Lockstep
from mlxq.models.loader import LoadedModel, load_model
from mlxq.models.pipeline_lora import install_pipeline_adapters, read_whole_adapters
from mlxq.models.sharded_lora import install_sharded_adapters, read_full_adapters
from mlxq.server.config import ServerConfig

log = logging.getLogger("mlxq.server")

FLUSH_ERRORS_S = 2.0  # after failing the open requests: time for their last events to reach the clients


def join_ranks(config: ServerConfig) -> Lockstep:
    world = join_world(config.world_size, config.distributed_backend, config.parallel_mode)
    log.info("%s parallel: rank %d of %d (backend %s)", world.mode, world.rank, world.size, world.backend)
    # Idle, rank 0 runs an iteration at least this often: a rank lost or hung is still seen within the timeout.
    return Lockstep(world, idle_heartbeat_s=min(1.0, config.stall_timeout_s / 4))


def rank_identity(config: ServerConfig, spec: str, engine_config: EngineConfig, world_size: int) -> dict:
    """What every rank must agree on before serving: the model's files, the engine's flags, the world."""
    from mlxq.models.loader import resolve_model_path

    path = resolve_model_path(spec)
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    model = hashlib.sha256()
    for file in files:
        model.update(file.name.encode())
        model.update(file.read_bytes() if file.suffix == ".json" else str(file.stat().st_size).encode())
    flags = {f"engine.{k}": v for k, v in dataclasses.asdict(engine_config).items()}
    return {"mlxq": __version__, "world_size": world_size, "mode": config.parallel_mode,
            "model files": model.hexdigest(), **flags}


def rank_engine(config: ServerConfig, spec: str, lockstep: Lockstep, engine_config: EngineConfig) -> Engine:
    """An engine whose load agrees with the other ranks, then loads this rank's shard."""
    identity = rank_identity(config, spec, engine_config, lockstep.world.size)
    pipeline = lockstep.world.mode == "pipeline"
    split = pipeline_model if pipeline else shard_model
    size = lockstep.world.size
    read = (lambda model, specs: read_whole_adapters(model, specs, size)) if pipeline else read_full_adapters

    def load() -> LoadedModel:
        lockstep.one_stream()
        lockstep.agree(identity)
        adapters: list = []

        def read_then_split(model) -> None:
            if config.adapters:  # read against the whole layers, then each rank keeps its part
                adapters.extend(read(model, config.adapters))
            split(model, lockstep.world.group)

        loaded = load_model(spec, name=config.served_model_name, chat_template=config.chat_template,
                            shard=read_then_split)
        if adapters:
            infos, pieces = adapters
            if pipeline:  # whole layers: each rank adapts the ones it holds
                install_pipeline_adapters(loaded.model, infos, pieces, loaded.name)
            else:  # each adapter split the way its layer is
                install_sharded_adapters(loaded.model, infos, pieces, lockstep.world.group, loaded.name)
            loaded.adapters = {info.name: info for info in infos}
        lockstep.after_load()
        return loaded

    return Engine(load, engine_config, lockstep)


def run_follower(engine: Engine) -> None:
    """Run the engine until rank 0 says stop (exit 0) or it fails (exit 1); never returns."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 stops this rank in order
    engine.start()
    engine.wait_finished()
    if engine.fatal_error:
        log.critical("rank %d stopped: %s", engine.lockstep.world.rank, engine.fatal_error)
    # os._exit: the engine thread parks (engine.py: a thread that ran MLX must not exit first)
    os._exit(1 if engine.fatal_error else 0)


def watch_ranks(state, lockstep: Lockstep) -> None:
    """Rank 0: a thread that ends the server when another rank is lost."""
    fd = os.environ.get(SUPERVISOR_FD_ENV)
    thread = threading.Thread(target=_watch, args=(state, lockstep, int(fd) if fd else None),
                              name="mlxq-rank-watch", daemon=True)
    thread.start()


def _read_notice(fd: int | None, timeout: float) -> str | None:
    """A line from the local launcher naming a rank that exited, if one came within ``timeout``."""
    if fd is None:
        time.sleep(timeout)
        return None
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return None
    data = os.read(fd, 4096).decode(errors="replace").strip()
    return data or None


def lost_rank(state, notice: str | None) -> str | None:
    """Why serving must stop, or None: a rank exited, the engine died, or it stalled (a rank hangs)."""
    engine = state.engine
    if notice:
        return notice
    if engine.fatal_error:
        return f"the engine stopped: {engine.fatal_error}"
    if not engine.is_alive:  # not started yet, or stopping on purpose
        return None
    idle = time.monotonic() - engine.last_progress_at
    if engine.ready.is_set() and idle > state.config.stall_timeout_s:
        return f"no engine progress for {idle:.0f}s: a rank is not answering (--stall-timeout)"
    return None


def _watch(state, lockstep: Lockstep, fd: int | None) -> None:
    while True:
        notice = _read_notice(fd, 0.2)
        reason = lost_rank(state, notice)
        if reason is None:
            continue
        if notice is None and fd is not None:  # the launcher may yet say which rank it was
            reason = _read_notice(fd, 1.0) or reason
        failed = lockstep.fail_open(f"{lockstep.world.mode} parallel: {reason}")
        log.critical("%s parallel: %s; %d open requests failed; exiting", lockstep.world.mode, reason, failed)
        time.sleep(FLUSH_ERRORS_S)
        os._exit(1)
