"""The engine thread: the one place MLX runs, fed by a thread-safe queue.

The HTTP side calls :meth:`Engine.submit` with a request and an ``emit``
callback (which must itself be thread-safe: the server hands events to its
event loop with ``call_soon_threadsafe``). Cancellation is the request's
own flag, read between steps. An exception while running one request fails
that request with an ERROR event; the thread goes on to the next one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from mlxq.engine.output import EmitFn
from mlxq.engine.types import FinishReason, Request, TokenEvent
from mlxq.models.loader import LoadedModel

log = logging.getLogger("mlxq.engine")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs, validated once; the CLI maps its flags onto these."""

    prefill_step_size: int = 2048  # prompt tokens per prefill forward pass

    def __post_init__(self):
        if self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")


@dataclass
class EngineStats:
    """Counters the engine thread updates and /stats reads (ints and floats only)."""

    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_decode_tok_s: float = 0.0


@dataclass
class _Work:
    request: Request
    emit: EmitFn


class Engine:
    """Owns MLX. ``load`` runs first on the engine thread, so even weight loading
    happens where every later MLX call does; ``ready`` is set once it returns."""

    def __init__(self, load: Callable[[], LoadedModel], config: EngineConfig):
        self._load = load
        self.loaded: LoadedModel | None = None
        self.ready = threading.Event()
        self.config = config
        self.stats = EngineStats()
        self._queue: queue.Queue[_Work | None] = queue.Queue()
        self._running: Request | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlxq-engine", daemon=True)
        self.last_progress_at = time.monotonic()  # heartbeat for /health
        self.fatal_error: str | None = None

    # --- called from any thread -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, emit: EmitFn) -> None:
        if not self.is_alive or not self.ready.is_set():
            raise RuntimeError("the engine is not running")
        self._queue.put(_Work(request, emit))

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current request; queued requests are cancelled."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def num_waiting(self) -> int:
        return self._queue.qsize()

    @property
    def num_running(self) -> int:
        return 1 if self._running is not None else 0

    # --- the engine thread ------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.loaded = self._load()
            self.ready.set()
            log.info("model ready: %s", self.loaded.description)
            while not self._stopping.is_set():
                self._beat()
                try:
                    work = self._queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                if work is None:
                    break
                self._run_one(work)
        except BaseException as exc:  # the thread must not die silently: /health reports it
            self.fatal_error = f"{type(exc).__name__}: {exc}"
            log.critical("engine thread died: %s", self.fatal_error, exc_info=True)
        finally:
            self._cancel_queued()

    def _beat(self) -> None:
        self.last_progress_at = time.monotonic()

    def _run_one(self, work: _Work) -> None:
        from mlxq.engine.serial import run_serial

        request = work.request
        if request.cancelled.is_set():
            work.emit(TokenEvent(request.request_id, finish_reason=FinishReason.CANCELLED))
            self.stats.requests_cancelled += 1
            return
        self._running = request
        try:
            output = run_serial(
                self.loaded.model,
                self.loaded.tokenizer,
                request,
                work.emit,
                prefill_step_size=self.config.prefill_step_size,
                on_step=self._beat,
            )
            self._account(output.usage(), output.finished)
        except Exception as exc:
            log.error("request %s failed: %s\n%s", request.request_id, exc, traceback.format_exc())
            self.stats.requests_failed += 1
            message = f"generation failed: {type(exc).__name__}: {exc}"
            work.emit(
                TokenEvent(request.request_id, finish_reason=FinishReason.ERROR, error=message)
            )
        finally:
            self._running = None

    def _account(self, usage, finished: FinishReason | None) -> None:
        self.stats.prompt_tokens += usage.prompt_tokens
        self.stats.generated_tokens += usage.completion_tokens
        if finished is FinishReason.CANCELLED:
            self.stats.requests_cancelled += 1
        else:
            self.stats.requests_finished += 1
        if usage.decode_tok_s:
            self.stats.last_decode_tok_s = usage.decode_tok_s

    def _cancel_queued(self) -> None:
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return
            if work is not None:
                work.emit(
                    TokenEvent(work.request.request_id, finish_reason=FinishReason.CANCELLED)
                )
