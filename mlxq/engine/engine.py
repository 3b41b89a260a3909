"""The engine thread: the one place MLX runs, fed by a thread-safe queue.

The HTTP side calls :meth:`Engine.submit` with a request and an ``emit``
callback (which must itself be thread-safe: the server hands events to its
event loop with ``call_soon_threadsafe``). Cancellation is the request's
own flag, read between steps.

Scheduling is one FIFO over both lanes, so neither starves the other:
the head of the queue is admitted to the batch when it is a continuous
request that fits; when the head is a serial request, batch admission
pauses, running rows finish (drain), the serial request runs alone, and
admission resumes.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mlxq.engine.admission import AdmissionError, check_fits_alone
from mlxq.engine.burst_hold import HeldUntil, OnTheWay, burst_quiet_at
from mlxq.engine.engine_calls import EngineCall
from mlxq.engine.faults import Evaluator, FaultInjector
from mlxq.engine.gateway import GenerationGateway, Lane, Placement, RequestShape
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.lockstep import Lockstep
from mlxq.engine.output import EmitFn
from mlxq.engine.serial_resume import SerialPreempted, SerialRun, backing_off
from mlxq.engine.types import FinishReason, Request, RequestDone, TokenEvent
from mlxq.models.loader import LoadedModel
from mlxq.models.multi_lora import adapter_names, adapter_rows
from mlxq.store.cold_tier import FlushResult
from mlxq.store.rank_restore import flush_state
from mlxq.store.ssd_config import SsdConfig

log = logging.getLogger("mlxq.engine")
INBOX_POLL_S = 0.25  # an idle engine waits this long for work before another loop iteration
ON_THE_WAY_POLL_S = 0.002  # a held burst's engine thread looks this often whether the server submitted the rest
# A held burst's engine thread takes in what arrived at most this often while the rest still arrives (0: only once
# it stopped arriving). 0: on the H200 a take-in every 5 ms slowed the event loop reading the rest of a 64-agent
# burst (the last request read at 178-213 ms against 106-144 with 0), past the hold's window, and the burst split
# in two forwards; admitted at its end it took ~40 ms. MLXQ_BURST_TAKE_IN_MS sets it (an A/B lever).
TAKE_IN_EVERY_S = float(os.environ.get("MLXQ_BURST_TAKE_IN_MS", "0")) / 1000


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs, validated once; the CLI maps its flags onto these."""

    prefill_step_size: int = 2048  # prompt tokens per prefill forward pass
    max_rows: int = 8  # --batch: concurrency cap; 1 = strict serial lane only
    prompt_concurrency: int = 4  # joiners prefilling at once (batch lane)
    burst_window_s: float | None = None  # a burst's tails wait this long for the rest; None: auto (burst_hold.py)
    kv_budget_bytes: int | None = None  # batch admission cap on projected KV bytes
    kv_budget_auto: bool = False  # without an explicit budget, derive one from the device's memory
    prompt_cache_bytes: int | None = None  # RAM prompt cache cap; 0 disables it; None: auto (engine/memory.py)
    ssd: SsdConfig | None = None  # the SSD cold tier behind the prompt cache
    kv_quant: str = "off"  # --kv-quant: off, a bit width, or config (kv.scheme)
    kv_group_size: int = 64
    warmup: str = "off"  # on, off, auto (on for GPU backends): engine/warmup.py before ready
    memory_limit_bytes: int | None = None  # MLX's memory limit; None: auto (engine/memory.py) unless off
    memory_limit_auto: bool = True  # False (--memory-limit off): leave MLX's own limits alone
    shared_prefix_attention: str = "off"  # auto, on, off: rows on one leased prefix read it once (batch lane)

    def __post_init__(self):
        if self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        if self.max_rows < 1:
            raise ValueError("batch must be >= 1")
        if self.prompt_concurrency < 1:
            raise ValueError("prompt_concurrency must be >= 1")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ValueError("kv_budget must be > 0")
        if self.prompt_cache_bytes is not None and self.prompt_cache_bytes < 0:
            raise ValueError("prompt_cache must be >= 0")
        if self.ssd is not None and self.prompt_cache_bytes == 0:
            raise ValueError("--ssd-cache needs the RAM prompt cache (--prompt-cache > 0): restores land there")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError("memory_limit must be > 0")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError("warmup must be auto, on or off")
        if self.shared_prefix_attention not in ("auto", "on", "off"):
            raise ValueError("shared_prefix_attention must be auto, on or off")


def _auto_declines_off_cuda() -> str:
    """Why ``--shared-prefix-attention auto`` never shares off CUDA: measured on the CPU, never on Metal."""
    from mlxq.kv import metal_decode_kernel

    if metal_decode_kernel.on_metal():
        return ("auto: not measured on Metal (--shared-prefix-attention on shares, through the Metal decode "
                "kernel once its start-up check passed)")
    return "auto: sharing measured no gain on this backend (CPU)"


def _on_gpu() -> bool:
    """MLX runs on a GPU backend (CUDA, Metal): forwards are bound by weight reads, kernels compile on first use."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


@dataclass
class EngineStats:
    """Counters the engine thread updates and /stats reads (ints and floats only)."""

    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_decode_tok_s: float = 0.0
    lanes: dict = field(default_factory=lambda: {"serial": 0, "continuous": 0})
    placement_reasons: dict = field(default_factory=dict)


@dataclass
class _Work:
    request: Request
    emit: EmitFn
    placement: Placement
    resume: SerialRun | None = None  # a serial request requeued after a memory fault: where it stopped
    arrived: float = field(default_factory=time.monotonic)  # submitted (time.monotonic): a burst's spacing


@dataclass
class _Flush:
    """A caller waiting until every dirty prompt-cache entry is on disk."""

    done: threading.Event = field(default_factory=threading.Event)
    result: FlushResult | None = None


class Engine:
    """Owns MLX. ``load`` runs first on the engine thread, so even weight loading
    happens where every later MLX call does; ``ready`` is set once it returns.

    Load inside ``load``, not before: on CUDA, arrays a model leaves lazy at load
    (mlx-lm's RoPE frequencies) belong to the loading thread's stream, and a model
    loaded on another thread fails here with "There is no Stream(gpu, 0) in current
    thread" (seen on the H200) unless that thread ran a forward first."""

    def __init__(self, load: Callable[[], LoadedModel], config: EngineConfig, lockstep: Lockstep | None = None):
        self._load = load
        self.lockstep = lockstep  # several ranks (tensor/pipeline parallel): their shared loop; None alone
        self.loaded: LoadedModel | None = None
        self.ready = threading.Event()
        self.config = config
        self.stats = EngineStats()
        self.grammar_timing = GrammarTiming()  # structured outputs' mask time, both lanes (/stats.grammar)
        self.gateway: GenerationGateway | None = None
        self.scheduler = None  # BatchScheduler once loaded, when the model can batch
        self.warmup_done = False  # the start-up warm-up ran (engine/warmup.py)
        self.cuda_attention = False  # attention routed past cuDNN builds and masked fallbacks (kv/cuda_attention.py)
        self.cpu_attention = False  # prefill softmax by blocks, exact (kv/cpu_attention.py)
        self.footprint = None  # KvFootprint once loaded
        self.kv_budget_bytes: int | None = config.kv_budget_bytes  # the effective budget (auto resolved at load)
        self.scheme = None  # kv.scheme.KvScheme once loaded
        self._prototype: list = []  # one populated, converted cache list: what every request's caches look like
        self._memory_seen: tuple[int | None, int] | None = None  # see _memory
        self.device_memory = None  # engine.memory.DeviceMemory, read once after the weights load
        self.usable_memory: int | None = None  # what the budgets and MLX's limits are planned within
        self.memory_limits = None  # engine.memory.MemoryLimits applied to MLX (None: MLX's own)
        self.prompt_cache = None  # store.PromptCache once loaded, when enabled and the model allows it
        self.prompt_cache_off_reason: str | None = None
        self.cold = None  # store.ColdTier once loaded, with --ssd-cache
        self.cold_off_reason: str | None = None
        self.checkpoints = None  # engine.checkpointing.Checkpointing, with --ssd-cache and --checkpoint-interval > 0
        self._flushes: list[_Flush] = []
        self._inbox: queue.Queue[_Work | _Flush | EngineCall | None] = queue.Queue()
        self._put_back: list = []  # taken from the inbox during a forward and left for the next intake, in order
        self._newest_arrival = 0.0  # the newest submission's time.monotonic (see _await_burst)
        self.on_the_way = OnTheWay()  # the server counts requests read and not yet submitted here
        self._calls: list[EngineCall] = []  # taken in, run when the loop stands between iterations
        self._waiting: collections.deque[_Work] = collections.deque()
        self._held: list[tuple[int, _Work | _Flush]] = []  # several ranks, rank 0: (iteration taken, work)
        # until every rank takes it in (engine/lockstep.py)
        self._stop_taken = False  # several ranks, rank 0: the stop is shared; nothing more is taken in
        self._serial_running: Request | None = None
        self._stopping = threading.Event()
        self._finished = threading.Event()  # the loop has ended (the thread itself parks, see _park)
        self._thread = threading.Thread(target=self._loop, name="mlxq-engine", daemon=True)
        self.last_progress_at = time.monotonic()  # heartbeat for /health
        self.fatal_error: str | None = None
        self._observers: list[Callable[[RequestDone], None]] = []
        self.evaluator = Evaluator(FaultInjector.from_env())  # MLXQ_FAULT_INJECT: a bad spec fails here, at start

    # --- called from any thread -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add_observer(self, observer: Callable[[RequestDone], None]) -> None:
        """Called on the engine thread once per finished request; must be quick and never raise."""
        self._observers.append(observer)

    def check_admissible(self, num_prompt: int, max_tokens: int) -> None:
        """Raise AdmissionError when a request could never be admitted (pure Python, any thread)."""
        budget = self.kv_budget_bytes
        if budget is None or self.footprint is None or self.gateway is None or self.gateway.mode != "batch":
            return
        check_fits_alone(self.footprint, budget, num_prompt, max_tokens)

    def submit(self, request: Request, emit: EmitFn) -> Placement:
        if not self.is_alive or not self.ready.is_set():
            raise RuntimeError("the engine is not running")
        placement = self.gateway.place(RequestShape.of(request))
        if self.lockstep is not None:
            request, emit = self.lockstep.track(request, emit)
        work = _Work(request, self._counting(emit), placement)
        self._newest_arrival = work.arrived  # a held burst's engine thread reads it when it wakes
        self._inbox.put(work)
        return placement

    def _counting(self, emit: EmitFn) -> EmitFn:
        """``emit`` that also counts each generated token as it is handed out (engine thread), so
        /stats and the dashboard's tok/s move while long generations run, not when they end."""
        stats = self.stats

        def counted(event: TokenEvent) -> None:
            if event.token_id is not None:
                stats.generated_tokens += 1
            emit(event)

        return counted

    def flush_cache(self, timeout: float) -> FlushResult | None:
        """Block until every dirty prompt-cache entry is on disk (or ``timeout``); None without an SSD tier.

        Any thread. The engine writes between its steps, so requests keep running meanwhile.
        """
        if self.cold is None:
            return None
        started = time.monotonic()
        result = self._flush_cold(timeout)  # first: the engine thread publishes staged checkpoint links
        left = max(0.0, timeout - (time.monotonic() - started))
        checkpoints = self.checkpoints.store.flush(left) if self.checkpoints is not None else None
        if checkpoints is None:
            return result
        return replace(result, durable=result.durable and checkpoints.durable, checkpoints=checkpoints.as_dict())

    def _flush_cold(self, timeout: float) -> FlushResult:
        if not self.is_alive:
            return self.cold.flush_result(timed_out=True, report=False)
        flush = _Flush()
        self._inbox.put(flush)
        if flush.done.wait(timeout) and flush.result is not None:
            return flush.result
        return self.cold.flush_result(timed_out=True, report=False)

    def call_between_steps(self, fn: Callable[[], object], timeout: float) -> object:
        """Run ``fn`` on the engine thread between two steps and return its result (any thread; raises
        what ``fn`` raises, or engine_calls.EngineCallTimeout when the engine did not get to it)."""
        if not self.is_alive:
            raise RuntimeError("the engine is not running")
        call = EngineCall(fn)
        self._inbox.put(call)
        return call.wait(timeout)

    def requests_held(self) -> list[Request]:
        """Engine thread: every request it holds, waiting, prefilling, decoding or preempted."""
        held = [work.request for work in self._waiting]
        held += [work.request for _, work in self._held if isinstance(work, _Work)]  # rank 0: not yet shared
        return held + (self.scheduler.requests_held() if self.scheduler is not None else [])

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step; queued and running requests are cancelled."""
        self._stopping.set()
        self._inbox.put(None)
        self._finished.wait(timeout)

    def wait_finished(self, timeout: float | None = None) -> bool:
        """True once the loop has ended (stopped, or the thread died)."""
        return self._finished.wait(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._finished.is_set() and not self._stopping.is_set()

    @property
    def num_waiting(self) -> int:
        preempted = self.scheduler.num_preempted if self.scheduler else 0
        held = sum(isinstance(work, _Work) for _, work in self._held)  # rank 0: taken, not yet shared
        return self._inbox.qsize() + held + len(self._waiting) + preempted

    @property
    def num_running(self) -> int:
        rows = self.scheduler.num_rows + self.scheduler.num_prefilling if self.scheduler else 0
        return rows + (1 if self._serial_running is not None else 0)

    # --- the engine thread ------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.loaded = self._load()
            self._setup_lanes()
            self._warm_up()
            self.ready.set()
            log.info("model ready: %s (batch mode: %s)", self.loaded.description, self.gateway.mode)
            # Ranks in lockstep stop together, at the iteration the stop is shared (a rank leaving
            # before it would leave the others waiting in a collective).
            while self.lockstep is not None or not self._stopping.is_set():
                self._beat()
                if not self._intake(block=self._idle() and not self._background_work()):
                    break
                self._run_calls()
                self._schedule()
                self._persist()
        except BaseException as exc:  # the thread must not die silently: /health reports it
            self.fatal_error = f"{type(exc).__name__}: {exc}"
            log.critical("engine thread died: %s", self.fatal_error, exc_info=True)
        finally:
            self._cancel_everything()
            self._drain_device()
            self._finished.set()
            self._park()

    @staticmethod
    def _park() -> None:
        """Never return: a thread that ran MLX must not exit before the process does.

        Seen with mlx 0.32.4 on Linux CPU: when a thread that used MLX (its
        thread-local generation stream) exits and the process then exits, the
        C++ runtime aborts in about half the runs ("terminate called without an
        active exception", exit -6), turning a clean SIGTERM into a crash. The
        daemon thread parks instead and is discarded at exit (0 aborts in 12 runs).
        """
        threading.Event().wait()

    @staticmethod
    def _drain_device() -> None:
        """Wait for queued MLX work before the engine thread ends.

        A pipelined step may still be running for a row that already finished;
        if the process exits while MLX's stream worker holds it, the C++ runtime
        aborts ("terminate called without an active exception", exit -6).
        """
        try:
            import mlx.core as mx

            mx.synchronize()
        except Exception:  # best effort during shutdown
            log.debug("synchronize at shutdown failed", exc_info=True)

    def _setup_lanes(self) -> None:
        from mlxq.kv.capabilities import UnknownCacheKind, model_cache_kinds
        from mlxq.kv.cpu_attention import install as install_cpu_attention
        from mlxq.kv.cuda_attention import install as install_cuda_attention
        from mlxq.kv.projection import measure_footprint
        from mlxq.kv.scheme import head_dims, probe_caches, resolve_scheme

        self.cuda_attention = install_cuda_attention()  # after the load: routes the model's attention calls
        self.cpu_attention = not self.cuda_attention and install_cpu_attention()  # the CPU backend's twin
        probe = probe_caches(self.loaded.model)
        self.scheme = resolve_scheme(self.config.kv_quant, self.config.kv_group_size, self.loaded.path, probe,
                                     head_dims(probe))
        self.scheme.convert(probe)  # the representation every request's caches end up in
        self._prototype = probe
        if self.scheme.quantized:
            log.info("KV scheme %s: bits per layer %s", self.scheme.key, list(self.scheme.layer_bits))
        reason = None
        try:
            model_cache_kinds(probe)
            self.footprint = measure_footprint(self.loaded.model, self.config.prefill_step_size, self.scheme, probe)
            if self.lockstep is not None:  # ranks holding other layers (pipeline) must still project alike
                self.footprint = self.lockstep.from_leader(self.footprint)
        except UnknownCacheKind as exc:
            reason = str(exc)
            log.warning("continuous batching unavailable for this model: %s; every request runs serially", exc)
        self.gateway = GenerationGateway(self.config.max_rows, reason)
        self._setup_prompt_cache()
        self.kv_budget_bytes = self._resolve_kv_budget()
        self._apply_memory_limits()
        if self.gateway.mode == "batch":
            from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
            from mlxq.engine.transient import ModelShape

            self.scheduler = BatchScheduler(
                self.loaded.model, self.loaded.tokenizer, self.footprint,
                SchedulerConfig(self.config.max_rows, self.config.prompt_concurrency,
                                self.config.prefill_step_size, self.kv_budget_bytes,
                                token0_in_decode=_on_gpu(),
                                transient_budget_bytes=self.memory_limits.transient_reserve if self.memory_limits
                                else None, shape=ModelShape.of(self.loaded.model),
                                memory_limit_bytes=self._shedding_limit(), burst=self._burst_hold()),
                on_finish=lambda row: self._done(row.output.request, Lane.CONTINUOUS, row.output.finished,
                                                 row.output.usage()),
                prompt_cache=self.prompt_cache, scheme=self.scheme, evaluator=self.evaluator,
                grammar_timing=self.grammar_timing, sharing=self._sharing_policy(), checkpoints=self.checkpoints,
            )
            self.scheduler.await_arrival = self._await_burst
            self.scheduler.on_the_way = self.on_the_way.pending
            self.scheduler.take_in_meanwhile = self._take_in_meanwhile

    def _burst_hold(self):
        """A burst of agents' tails waits for the rest of it on a GPU (one forward for the wave);
        not on the compute-bound CPU (no forward to share), nor across ranks (a wall-clock decision
        each rank would make apart); ``burst_window_s`` (--burst-window-ms) overrides the window."""
        from mlxq.engine.burst_hold import BURST_GAP_S, BURST_WINDOW_S, BurstHold

        if self.lockstep is not None:
            return BurstHold(0.0)
        window = self.config.burst_window_s
        return BurstHold((BURST_WINDOW_S if _on_gpu() else 0.0) if window is None else window, BURST_GAP_S)

    def _shedding_limit(self) -> int | None:
        """The memory limit rows are shed against. Not with several ranks: shedding reads this rank's
        allocator, and ranks must decide alike (the KV budget, a projection, still bounds admission)."""
        if self.memory_limits is None or self.lockstep is not None:
            return None
        return self.memory_limits.memory_limit

    def _sharing_policy(self):
        """--shared-prefix-attention: which layers of this model can share, probed once at load."""
        import mlx.core as mx

        from mlxq.engine.prefix_sharing import SharingPolicy
        from mlxq.kv.sharing_plan import plan_sharing

        mode = self.config.shared_prefix_attention
        if self.prompt_cache is None:
            return SharingPolicy(mode, None, unplanned="no prompt cache (groups come from its leases)")
        if mode == "auto" and not mx.cuda.is_available():  # the model's attention calls stay as they were
            return SharingPolicy(mode, None, unplanned=_auto_declines_off_cuda())
        if mode == "off":
            return SharingPolicy(mode, None)
        plan = plan_sharing(self.loaded.model)
        if plan.declined:
            log.info("shared-prefix attention declined: %s", plan.declined)
        return SharingPolicy(mode, plan)

    def _warm_up(self) -> None:
        from mlxq.engine.warmup import warm_up

        wanted = self.config.warmup
        if wanted == "off" or (wanted == "auto" and not _on_gpu()):
            return
        try:
            seconds = warm_up(self.loaded.model, self.loaded.tokenizer, self.scheme, self.config.prefill_step_size,
                              self.scheduler)
            log.info("warm-up: every generation path ran once in %.1fs", seconds)
            if self.checkpoints is not None:
                from mlxq.engine.checkpoint_spans import warm

                warm(self.loaded.model)  # the batch lane's checkpoint copy kernel, compiled and checked
            self.warmup_done = True
        except Exception:  # serving may still work: say so and go on
            log.warning("warm-up failed", exc_info=True)

    def _memory(self) -> tuple[int | None, int]:
        """(usable memory, weight bytes): what the automatic sizes start from (read once, after the load).

        Usable: --memory-limit, or the device's share bounded by what is free beside this process."""
        if self._memory_seen is None:
            from mlxq.engine.memory import read_device_memory, usable_bytes, weight_bytes

            self.device_memory = read_device_memory()
            usable = self.config.memory_limit_bytes or usable_bytes(self.device_memory)
            weights = weight_bytes(self.loaded.model)
            if self.lockstep is not None:  # every rank plans alike: within the smallest memory, rank 0's weights
                usable, weights = self.lockstep.agree_min(usable), self.lockstep.from_leader(weights)
            self._memory_seen = (usable, weights)
            self.usable_memory = usable
        return self._memory_seen

    def _apply_memory_limits(self) -> None:
        """Bound MLX's allocator by the same arithmetic as the budgets (engine/memory.py)."""
        if not self.config.memory_limit_auto and self.config.memory_limit_bytes is None:
            return
        from mlxq.engine.memory import apply_limits, plan_limits

        usable, weights = self._memory()
        if usable is None:
            return
        cache = self.prompt_cache.max_bytes if self.prompt_cache is not None else 0
        self.memory_limits = plan_limits(usable, weights, cache, self.kv_budget_bytes)
        apply_limits(self.memory_limits)
        log.info("MLX memory limit %.2f GB, cache limit %.2f GB (transient reserve %.2f GB)",
                 self.memory_limits.memory_limit / 1e9, self.memory_limits.cache_limit / 1e9,
                 self.memory_limits.transient_reserve / 1e9)

    def _resolve_kv_budget(self) -> int | None:
        if self.config.kv_budget_bytes is not None or not self.config.kv_budget_auto:
            return self.config.kv_budget_bytes
        from mlxq.engine.memory import auto_kv_budget_bytes

        total, weights = self._memory()
        cache = self.prompt_cache.max_bytes if self.prompt_cache is not None else 0
        budget = auto_kv_budget_bytes(total, weights, cache)
        if budget is not None:
            log.info("KV budget: %.2f GB (auto: 70%% of the memory the weights and the prompt cache leave)",
                     budget / 1e9)
        return budget

    def _setup_prompt_cache(self) -> None:
        from mlxq.store.prompt_cache import PromptCache, can_cache

        caches = self._prototype
        cap = self.config.prompt_cache_bytes
        if cap is None:
            from mlxq.engine.memory import auto_prompt_cache_bytes

            total, weights = self._memory()
            cap = auto_prompt_cache_bytes(total, weights)
            log.info("RAM prompt cache: %.2f GB (auto: a quarter of %s left after the weights, at most 8 GB)",
                     cap / 1e9, f"{total / 1e9:.1f} GB" if total else "the memory")
        if cap == 0:
            self.prompt_cache_off_reason = "disabled (--prompt-cache 0)"
        elif not can_cache(caches):
            names = sorted({type(c).__name__ for c in caches})
            self.prompt_cache_off_reason = f"no prompt-cache support for cache classes {names}"
        else:
            self.prompt_cache = PromptCache(cap, charge=self._pipeline_charge())
        if self.config.ssd is None:
            self.cold_off_reason = "off (start with --ssd-cache DIR)"
        elif self.prompt_cache is None:
            self.cold_off_reason = f"needs the RAM prompt cache, which is {self.prompt_cache_off_reason}"
            log.warning("SSD cache off: %s", self.cold_off_reason)
        else:
            from mlxq.engine.checkpointing import open_checkpointing
            from mlxq.store.cold_tier import open_cold_tier

            self.cold = open_cold_tier(self.config.ssd, self.prompt_cache, self.loaded.path, self.loaded.name,
                                       kv_scheme=self.scheme.key, prototype=self._prototype, ranks=self._ranks())
            self.checkpoints = open_checkpointing(self.config.ssd, self.cold.store, self.scheme.key)

    def _pipeline_charge(self):
        """Pipeline parallel: rank 0's bytes per token and per snapshot, so every rank evicts alike."""
        if self.lockstep is None or self.lockstep.world.mode != "pipeline":
            return None
        from mlxq.store.charge import measure_charge

        return self.lockstep.from_leader(measure_charge(self._prototype))

    def _ranks(self):
        """Several ranks: this rank's place and the collective its SSD restores agree through."""
        from mlxq.store.rank_restore import Ranks

        world = self.lockstep.world if self.lockstep is not None else None
        return Ranks(world.rank, world.size, self.lockstep.gather_one, world.mode) if world is not None else None

    def _background_work(self) -> bool:
        """SSD work waiting (asked only when idle: never a cost on the decode loop), here or, for a flush,
        on another rank (which writes at this rank's pace)."""
        if self.cold is None:
            return False
        others = bool(self._flushes) and self.lockstep is not None and not self.lockstep.others_flushed
        return others or self.cold.has_work(flushing=bool(self._flushes))

    def _persist(self) -> None:
        """SSD work: one tensor per iteration, only when idle unless a flush is waiting."""
        cold = self.cold
        if cold is None:
            return
        if self._flushes:
            if cold.has_work(flushing=True):
                cold.step()
                return
            if self.lockstep is not None and not self.lockstep.others_flushed:
                return  # the flush is durable once every rank's part is
            result = cold.flush_result()
            if self.lockstep is not None and not self.lockstep.others_durable:
                result = replace(result, durable=False)
            for flush in self._flushes:
                flush.result = result
                flush.done.set()
            self._flushes.clear()
            return
        if self._idle() and self._serial_running is None:
            if cold.has_work():
                cold.step()
            else:
                cold.housekeep()

    def _idle(self) -> bool:
        return not self._waiting and (self.scheduler is None or self.scheduler.is_idle)

    def _intake(self, block: bool) -> bool:
        """Move submitted work into the FIFO; False when asked to stop."""
        if self.lockstep is not None:
            return self._intake_lockstep(block)
        for work in self._drain_inbox(block):
            if work is None:
                return False
            if isinstance(work, _Flush):
                self._take_flush(work)
            elif isinstance(work, EngineCall):
                self._calls.append(work)  # not here: the serial lane takes its inbox in mid-request
            elif work.request.adapter and work.request.adapter not in adapter_names(self.loaded.model):
                self._fail(work, f"model {work.request.adapter!r} was unloaded before this request started")
            else:
                self._admit_to_fifo(work)
        return True

    def _await_burst(self, held: HeldUntil) -> None:
        """While a held burst is still arriving (nothing decodes): sleep until no request has been
        submitted for the hold's gap, or its window ends (burst_hold.burst_quiet_at), taking in what
        was submitted meanwhile at most every ``TAKE_IN_EVERY_S`` (one pass and one held step for
        all of it). The thread does not wake per arrival: each wake-up took the GIL from the event
        loop reading the rest of the burst, and each admission planned the held step again over
        every joiner."""
        gap, started = self.scheduler.config.burst.gap_s, time.monotonic()
        while not self._stopping.is_set():
            now = time.monotonic()
            if TAKE_IN_EVERY_S and now - started >= TAKE_IN_EVERY_S and self._inbox.qsize():
                return  # take in what arrived so far, then sleep on (see TAKE_IN_EVERY_S)
            on_the_way = self.on_the_way.pending(now)
            # A request settles just before its submission: either time is its arrival.
            newest = max(self._newest_arrival, self.on_the_way.settled_at)
            left = burst_quiet_at(held, newest, gap, on_the_way) - now
            if left <= 0:
                return
            nap = ON_THE_WAY_POLL_S if on_the_way else (TAKE_IN_EVERY_S or left)
            time.sleep(min(left, nap))

    def _take_in_meanwhile(self) -> None:
        """While a held burst's forward runs (``Prefilling._meanwhile``, engine thread): requests
        submitted since go into the FIFO, and the continuous-lane ones at its head into the scheduler
        while they fit. Nothing else is taken in here: from the first item that is not a plain
        request (a stop, a flush, an engine call, an adapter's request) the inbox's items wait, in
        order, for the loop's next intake; nothing is rejected and no step runs."""
        if self.lockstep is not None or self._put_back or not self._inbox.qsize():
            return
        for work in self._drain_inbox(block=False):
            if self._put_back or not isinstance(work, _Work) or work.request.adapter:
                self._put_back.append(work)
            else:
                self._admit_to_fifo(work)
        while self._waiting and self._waiting[0].placement.lane is Lane.CONTINUOUS:
            head = self._waiting[0]
            if head.request.cancelled.is_set() or not self.scheduler.can_admit(head.request):
                return
            self._waiting.popleft()
            self.scheduler.add(head.request, head.emit, arrived=head.arrived)

    def _take_flush(self, flush: _Flush) -> None:
        if self.scheduler is not None:
            self.scheduler.publish_staged()  # so the checkpoint flush after this one covers them
        if not self._flushes:
            self.cold.begin_flush()
        self._flushes.append(flush)

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            call.run()

    def _fail(self, work: _Work, message: str) -> None:
        work.emit(TokenEvent(work.request.request_id, finish_reason=FinishReason.ERROR, error=message))
        self._done(work.request, work.placement.lane, FinishReason.ERROR, None, message)

    def _drain_inbox(self, block: bool, timeout: float = INBOX_POLL_S) -> list[_Work | _Flush | None]:
        """What was submitted, up to a stop (None); waits up to ``timeout`` for the first item when ``block``."""
        taken, self._put_back = self._put_back, []  # first what a forward's take-in left, in order
        if any(work is None for work in taken):
            return taken
        block = block and not taken
        try:
            work = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            while True:
                taken.append(work)
                if work is None:
                    return taken
                work = self._inbox.get_nowait()
        except queue.Empty:
            return taken

    def _intake_lockstep(self, block: bool) -> bool:
        """Several ranks: rank 0's arrivals, cancellations and stop enter every rank's FIFO alike, two
        iterations after rank 0 took them (engine/lockstep.py); rank 0 holds them meanwhile."""
        leader = self.lockstep.world.is_leader
        block = block and not self.lockstep.news_in_flight

        def drain(timeout: float) -> list:
            return self._drain_inbox(block, timeout) if leader and not self._stop_taken else []

        taken = self.lockstep.idle_wait(drain, INBOX_POLL_S)  # idle ranks sleep there, without spinning
        self._stop_taken = self._stop_taken or None in taken
        works = [work for work in taken if isinstance(work, _Work)]
        flushes = [work for work in taken if isinstance(work, _Flush)]
        scheduler = self.scheduler
        digest = [len(self._waiting), scheduler.num_rows if scheduler else 0,
                  scheduler.num_prefilling if scheduler else 0, self.stats.generated_tokens]
        now = self.lockstep.iterations + 1  # the iteration this exchange makes
        self._held += [(now, work) for work in (*works, *flushes)]  # failed, not lost, should the exchange raise
        arrivals = self.lockstep.exchange([work.request for work in works], None in taken, digest,
                                          flush=bool(flushes), ssd_state=flush_state(self.cold, bool(self._flushes)),
                                          quiet=block)
        shared = [work for at, work in self._held if at <= arrivals.taken_at]  # every rank takes them in now
        self._held = [(at, work) for at, work in self._held if at > arrivals.taken_at]
        held_flushes = [work for work in shared if isinstance(work, _Flush)]
        for flush in (held_flushes or [_Flush()]) if arrivals.flush else ():  # a follower's: nobody waits on it
            self._take_flush(flush)
        for work in shared:
            if isinstance(work, _Work):
                self._admit_to_fifo(work)
        for request, emit in arrivals.requests:
            self._admit_to_fifo(_Work(request, self._counting(emit), self.gateway.place(RequestShape.of(request))))
        return not arrivals.stop

    def _admit_to_fifo(self, work: _Work) -> None:
        self._waiting.append(work)
        self.stats.lanes[work.placement.lane.value] += 1
        reasons = self.stats.placement_reasons
        reasons[work.placement.reason] = reasons.get(work.placement.reason, 0) + 1

    def _schedule(self) -> None:
        self._drop_cancelled_waiting()
        while self._waiting and self._waiting[0].placement.lane is Lane.CONTINUOUS:
            head = self._waiting[0]
            if not self.scheduler.can_admit(head.request):
                if self.scheduler.is_idle:  # it would not fit even alone: never wait forever
                    self._waiting.popleft()
                    self._reject(head)
                    continue
                break
            self._waiting.popleft()
            self.scheduler.add(head.request, head.emit, arrived=head.arrived)
        if self._waiting and self._waiting[0].placement.lane is Lane.SERIAL:
            if self.scheduler is None or self.scheduler.is_idle:
                if not backing_off(self._waiting[0].resume):  # a requeued request waits a moment first
                    self._run_serial(self._waiting.popleft())
                return
            # A serial request waits at the head: admission is paused, running rows drain.
        if self.scheduler is not None and not self.scheduler.is_idle:
            self.scheduler.step()

    def _reject(self, work: _Work) -> None:
        try:
            self.check_admissible(len(work.request.prompt_ids), work.request.max_tokens)
            message = "the request does not fit the KV budget"
        except AdmissionError as exc:
            message = str(exc)
        self._fail(work, message)

    def _drop_cancelled_waiting(self) -> None:
        if not any(w.request.cancelled.is_set() for w in self._waiting):
            return
        for work in [w for w in self._waiting if w.request.cancelled.is_set()]:
            self._waiting.remove(work)
            work.emit(TokenEvent(work.request.request_id, finish_reason=FinishReason.CANCELLED))
            self._done(work.request, work.placement.lane, FinishReason.CANCELLED, None)

    def _beat(self) -> None:
        self.last_progress_at = time.monotonic()

    def _run_serial(self, work: _Work) -> None:
        from mlxq.engine.serial import run_serial

        request = work.request
        self._serial_running = request
        try:
            with adapter_rows(self.loaded.model, [request.adapter]):
                output = run_serial(
                    self.loaded.model, self.loaded.tokenizer, request, work.emit,
                    prefill_step_size=self.config.prefill_step_size, on_step=self._serial_step,
                    prompt_cache=self.prompt_cache, scheme=self.scheme, grammar_timing=self.grammar_timing,
                    evaluator=self.evaluator, resume=work.resume, checkpoints=self.checkpoints,
                )
            self._done(request, Lane.SERIAL, output.finished, output.usage())
        except SerialPreempted as preempted:  # out of memory twice: first in line again, resumed later
            work.resume = preempted.run
            self._waiting.appendleft(work)
        except Exception as exc:
            log.error("request %s failed: %s\n%s", request.request_id, exc, traceback.format_exc())
            message = f"generation failed: {type(exc).__name__}: {exc}"
            work.emit(TokenEvent(request.request_id, finish_reason=FinishReason.ERROR, error=message))
            self._done(request, Lane.SERIAL, FinishReason.ERROR, None, message)
        finally:
            self._serial_running = None

    def _serial_step(self) -> None:
        """Between the serial lane's steps: beat, and take in flushes so they are answered mid-generation."""
        self._beat()
        # Only with an SSD tier to flush, and alone: ranks in lockstep take arrivals together, between iterations.
        if self.cold is not None and self.lockstep is None and self._inbox.qsize():
            self._intake(block=False)  # new requests join the FIFO behind this one; a stop is seen after it
        if self._flushes:
            self._persist()

    def _done(self, request: Request, lane: Lane, finished: FinishReason | None, usage, error=None) -> None:
        """Every request ends here exactly once: stats, then observers."""
        self._beat()
        finished = finished or FinishReason.ERROR
        if usage is not None:
            if self.cold is not None:
                self.cold.note_prefill(usage.prompt_tokens - usage.cached_tokens, usage.prefill_s)
            self.stats.prompt_tokens += usage.prompt_tokens
            if usage.decode_tok_s:
                self.stats.last_decode_tok_s = usage.decode_tok_s
        if finished is FinishReason.CANCELLED:
            self.stats.requests_cancelled += 1
        elif finished is FinishReason.ERROR:
            self.stats.requests_failed += 1
        else:
            self.stats.requests_finished += 1
            if self.checkpoints is not None:
                self.checkpoints.finished(request)
        done = RequestDone(request, lane.value, finished, usage, error)
        for observer in self._observers:
            try:
                observer(done)
            except Exception:  # an observer must never take a request or the engine down
                log.exception("request observer failed")

    def _cancel_everything(self) -> None:
        if self.scheduler is not None:
            self.scheduler.fail_all(f"the engine stopped: {self.fatal_error}" if self.fatal_error
                                    else "the server is shutting down")
        pending = [*self._waiting, *(work for _, work in self._held if isinstance(work, _Work))]
        self._flushes.extend(work for _, work in self._held if isinstance(work, _Flush))
        self._waiting.clear()
        self._held = []
        while True:
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(work, _Flush):
                self._flushes.append(work)
            elif work is not None:
                pending.append(work)
        for work in pending:
            work.emit(TokenEvent(work.request.request_id, finish_reason=FinishReason.CANCELLED))
        for flush in self._flushes:  # their callers time out and read the state themselves
            flush.done.set()

