"""Start a server: resolve the model, start the engine thread, run uvicorn.

Lifecycle (uvicorn's own CLI -> Config -> Server split): the engine starts
in the app's lifespan and loads the model on its own thread, so /health
answers 503 "loading" until it is ready; on SIGINT/SIGTERM uvicorn stops
accepting, gives open responses --shutdown-timeout to finish (server/shutdown.py), and
the lifespan flushes the SSD tier and stops the engine.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import sys
import threading
from pathlib import Path

import uvicorn

from mlxq import fd_limit
from mlxq.blas import active as active_blas
from mlxq.engine.engine import Engine, EngineConfig
from mlxq.models.default import ensure_default_model
from mlxq.models.loader import load_model, resolve_model_path
from mlxq.models.multi_lora import attach_adapters
from mlxq.server.app import build_app
from mlxq.server.config import ServerConfig
from mlxq.server.connections import connection_cap, deadline_protocol
from mlxq.server.log_setup import configure_logging
from mlxq.server.ranks import join_ranks, rank_engine, run_follower, watch_ranks
from mlxq.server.shutdown import Server
from mlxq.server.state import ServerState
from mlxq.store.ssd_lock import SsdLock

log = logging.getLogger("mlxq.server")


class PortInUseError(ValueError):
    """The address is taken: one line for the user, exit 2 (a bad flag), before anything loads."""


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a taken port fails at once and
    "listening" is only ever logged for a socket we hold (uvicorn serves on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} is in use on {host}; pass --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def model_spec(config: ServerConfig) -> str:
    """Resolve the model now (a missing model fails before the port opens); load it later."""
    if config.model is None:
        spec = str(ensure_default_model())
        log.info("no --model given: serving the embedded default model at %s", spec)
        return spec
    return str(resolve_model_path(config.model))


def engine_config(config: ServerConfig) -> EngineConfig:
    return EngineConfig(prefill_step_size=config.prefill_step_size, max_rows=config.batch,
                        prompt_concurrency=config.prompt_concurrency,
                        burst_window_s=None if config.burst_window_ms is None else config.burst_window_ms / 1000,
                        kv_budget_bytes=config.kv_budget_bytes, kv_budget_auto=config.kv_budget_auto,
                        prompt_cache_bytes=config.prompt_cache_bytes, ssd=config.ssd,
                        memory_limit_bytes=config.memory_limit_bytes,
                        memory_limit_auto=config.memory_limit_auto,
                        kv_quant=config.kv_quant, kv_group_size=config.kv_group_size,
                        warmup=config.warmup,
                        shared_prefix_attention=config.shared_prefix_attention)


def make_state(config: ServerConfig, lockstep=None) -> ServerState:
    spec = model_spec(config)
    if lockstep is not None:
        return ServerState(config=config, engine=rank_engine(config, spec, lockstep, engine_config(config)))
    engine = Engine(lambda: attach_adapters(load_model(spec, name=config.served_model_name,
                                                      chat_template=config.chat_template), config.adapters),
                    engine_config(config))
    return ServerState(config=config, engine=engine)


def serve(config: ServerConfig) -> None:
    if "MLXQ_GIL_SWITCH_INTERVAL" in os.environ:
        # Measured on the H200 (docs/benchmarks.md): 0.5 ms made c=64 27% slower than
        # Python's default 5 ms, so the default stays; the knob is for experiments.
        sys.setswitchinterval(float(os.environ["MLXQ_GIL_SWITCH_INTERVAL"]))
    configure_logging(config.log_level, config.log_format)
    blas = active_blas()
    log.info("BLAS: %s (%s)", blas.name, blas.path or blas.reason)
    if blas.name == "bundled-reference":
        log.warning("slow CPU math: %s", blas.reason)
    if not config.is_loopback and config.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the model "
                    "and read /stats; set --api-key (or MLXQ_API_KEY) or bind to 127.0.0.1", config.host)
    lockstep = join_ranks(config) if config.world_size > 1 else None
    if lockstep is not None and not lockstep.world.is_leader:
        run_follower(rank_engine(config, model_spec(config), lockstep, engine_config(config)))  # never returns
    listener = bind_listener(config.host, config.port)
    lock = SsdLock(Path(config.ssd.directory)).acquire() if config.ssd is not None else None  # held until exit
    state = make_state(config, lockstep)
    app = build_app(state)
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                   log_config=None, access_log=False,  # mlxq logs each request once
                                   timeout_graceful_shutdown=config.shutdown_timeout_s,
                                   **_connection_limits(config, state)),
                    grace_s=config.shutdown_timeout_s)
    threading.Thread(target=_watch_model_load, args=(state, server), daemon=True).start()
    if lockstep is not None:
        watch_ranks(state, lockstep)
    log.info("mlxq listening on http://%s:%d", config.host, config.port)
    server.run(sockets=[listener])
    if lock is not None:
        lock.release()
    if state.engine.fatal_error and not state.engine.ready.is_set():
        raise SystemExit(1)


def _connection_limits(config: ServerConfig, state: ServerState) -> dict:
    """uvicorn settings that keep slow or numerous clients from locking others out (server/connections.py)."""
    cap = connection_cap(config.max_connections, fd_limit.restore())
    return {"http": deadline_protocol(config.request_read_timeout_s, state.engine.on_the_way),
            "limit_concurrency": cap,
            "backlog": min(cap, 4096)}


def _watch_model_load(state: ServerState, server: uvicorn.Server) -> None:
    """A model that fails to load should end the process, not leave a 503 forever.

    Once it is loaded, the heap built so far (model wrappers, tokenizer, templates: ~300k objects
    on the tiny model) leaves the cyclic collector's view (``gc.freeze``): the full collection
    that a big request's allocations trigger would otherwise walk all of it holding the GIL,
    stalling every stream (0.5 s measured for a 100k-message body).
    """
    while not state.engine.ready.wait(0.2):
        if state.engine.fatal_error:
            log.critical("model failed to load: %s", state.engine.fatal_error)
            server.should_exit = True
            return
    gc.freeze()
