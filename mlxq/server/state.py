"""What the routes share: config, the loaded model, the engine, health and stats."""

from __future__ import annotations

import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field

from mlxq import __version__
from mlxq.blas import active as active_blas
from mlxq.engine.engine import Engine
from mlxq.models.loader import LoadedModel
from mlxq.server.config import ServerConfig
from mlxq.server.errors import APIError
from mlxq.server.memory_stats import memory_plan
from mlxq.server.metrics import ServerMetrics
from mlxq.server.request_log import RequestLogger


@dataclass
class ServerState:
    config: ServerConfig
    engine: Engine
    started_at: float = field(default_factory=time.monotonic)
    started_at_wall: float = field(default_factory=time.time)
    metrics: ServerMetrics = field(init=False)
    # An adapter was loaded at run time (POST /admin/adapters): from then on, also once every adapter is
    # unloaded again, ``model`` must name what is served (model_routing.py), so an unloaded name is a 404.
    adapters_loaded_at_run_time: bool = False

    def __post_init__(self):
        self.metrics = ServerMetrics(self)
        self.engine.add_observer(self.metrics.observe)
        self.engine.add_observer(RequestLogger(self.config.log_format, self.config.log_prompts,
                                               lambda: self.loaded.tokenizer if self.loaded else None))

    def is_ready(self) -> bool:
        """Model loaded and admitting requests."""
        return self.engine.is_alive and self.engine.ready.is_set()

    @property
    def loaded(self) -> LoadedModel | None:
        """The model, once the engine thread has loaded it (None before)."""
        return self.engine.loaded

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.loaded.name if self.loaded else "loading"

    def require_ready(self) -> None:
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if not self.engine.ready.is_set():
            raise APIError(503, "the model is still loading; retry shortly", code="loading")

    def health(self) -> tuple[bool, str]:
        """Healthy means: loaded, engine thread alive, and making progress when it has work."""
        engine = self.engine
        if engine.lockstep is not None and engine.lockstep.failure:
            return False, engine.lockstep.failure
        if not engine.is_alive:
            return False, f"engine thread stopped: {engine.fatal_error or 'shutdown'}"
        if not engine.ready.is_set():
            return False, "loading"
        idle_for = time.monotonic() - engine.last_progress_at
        if idle_for > self.config.stall_timeout_s:
            return False, f"engine made no progress for {idle_for:.0f}s"
        return True, "ok"

    def _batch_stats(self) -> dict:
        engine = self.engine
        scheduler = engine.scheduler
        gateway = engine.gateway
        return {
            "configured": engine.config.max_rows,
            "mode": gateway.mode if gateway else "loading",
            "not_batchable_reason": gateway.batch_unavailable if gateway else None,
            "active_rows": scheduler.num_rows if scheduler else 0,
            "prefilling_rows": scheduler.num_prefilling if scheduler else 0,
            "pending_rows": engine.num_waiting,
            "submitted_rows": scheduler.submitted_rows if scheduler else 0,
            "shared_prefills": scheduler.shared_prefills if scheduler else 0,
            "kv_bytes": scheduler.projected_bytes() if scheduler else 0,
            "kv_budget_bytes": engine.kv_budget_bytes,
            "prompt_concurrency": engine.config.prompt_concurrency,
            "burst_window_ms": scheduler.config.burst.window_s * 1000 if scheduler else None,
            # requests read in full and not yet submitted: a burst's rest on its way (engine/burst_hold.py)
            "on_the_way": engine.on_the_way.pending(time.monotonic()),
            # allocation faults: retried, rows requeued (preempted) and waiting, the caps they lowered
            "faults": asdict(engine.evaluator.counters),
            "preempted_rows": scheduler.num_preempted if scheduler else 0,
            "row_cap": scheduler.caps.rows if scheduler else engine.config.max_rows,
            "prefill_transient_bytes": scheduler.transient_bytes() if scheduler else 0,
            # each decode step timed in its parts (engine/step_timing.py)
            "decode_timing": scheduler.timing.as_dict() if scheduler else None,
            # wall time in prefill and joins, and each phase's share of the scheduler's busy time
            "phase_timing": scheduler.phases.as_dict(scheduler.timing) if scheduler else None,
            # whole-row KV copies around joins (engine/wave_caches.py): what a burst of joiners costs per row
            "row_copies": scheduler.batch.copies.as_dict() if scheduler else None,
            # rows reading one leased prefix once per decode step (engine/prefix_sharing.py)
            "shared_prefix": scheduler.sharing_stats.as_dict(scheduler.sharing, scheduler.timing.steps,
                                                             scheduler.batch.groups) if scheduler else None,
        }

    def _kv_stats(self) -> dict:
        scheme, footprint = self.engine.scheme, self.engine.footprint
        return {
            "scheme": scheme.key if scheme else None,
            "cuda_attention": self.engine.cuda_attention,
            "cpu_attention": self.engine.cpu_attention,
            "group_size": scheme.group_size if scheme and scheme.quantized else None,
            "layer_bits": list(scheme.layer_bits) if scheme and scheme.quantized else None,
            "bytes_per_token": sum(layer.bytes_per_token for layer in footprint.layers) if footprint else None,
        }

    def stats(self) -> dict:
        """/stats; filesystem paths only when an API key guards it (else any local program could read them)."""
        full = self._all_stats()
        return full if self.config.api_key is not None else hide_paths(full)

    def _all_stats(self) -> dict:
        import mlx.core as mx

        engine = self.engine
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "model": {
                "id": self.model_name,
                "path": str(self.loaded.path) if self.loaded else None,
                "description": self.loaded.description if self.loaded else None,
                "context_length": self.loaded.context_length if self.loaded else None,
                "adapters": [{"name": a.name, "kind": a.kind, "rank": a.rank, "namespace": a.identity,
                              "path": str(a.path)} for a in (self.loaded.adapters if self.loaded else {}).values()],
            },
            "engine": {
                "alive": engine.is_alive,
                "ready": engine.ready.is_set(),
                "running": engine.num_running,
                "waiting": engine.num_waiting,
                "prefill_step_size": self.config.prefill_step_size,
                "warmed_up": engine.warmup_done,
                **asdict(engine.stats),
            },
            "batch": self._batch_stats(),
            "grammar": engine.grammar_timing.as_dict(),  # structured outputs: host time computing token masks
            "kv": self._kv_stats(),
            "prompt_cache": {
                "enabled": engine.prompt_cache is not None,
                "off_reason": engine.prompt_cache_off_reason,
                **(engine.prompt_cache.as_dict() if engine.prompt_cache is not None else {}),
            },
            "ssd_cache": engine.cold.as_dict() if engine.cold is not None else {
                "enabled": False, "off_reason": engine.cold_off_reason},
            "checkpoints": {"enabled": True, "interval": engine.checkpoints.interval,
                            **engine.checkpoints.store.as_dict()} if engine.checkpoints is not None else {
                "enabled": False},
            "memory": {
                "mlx_active_bytes": mx.get_active_memory(),
                "mlx_peak_bytes": mx.get_peak_memory(),
                "mlx_cache_bytes": mx.get_cache_memory(),
                "process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                **memory_plan(engine),
            },
            "distributed": engine.lockstep.as_dict() if engine.lockstep is not None else {"world_size": 1},
            "runtime": {
                "device": str(mx.default_device()),
                "mlx": mx.__version__,
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "blas": active_blas().as_dict(),
            },
        }


PATH_KEYS = frozenset({"path", "directory"})
HIDDEN_PATH = "(hidden: shown only when the server has --api-key)"


def hide_paths(stats):
    """``stats`` with the value of every "path"/"directory" key replaced (they reveal the home directory)."""
    if isinstance(stats, dict):
        return {k: (HIDDEN_PATH if k in PATH_KEYS and v is not None else hide_paths(v)) for k, v in stats.items()}
    if isinstance(stats, list):
        return [hide_paths(v) for v in stats]
    return stats
