"""The engine thread: failures stay inside one request, cancellation stops a row."""

from __future__ import annotations

import queue
import threading

import mlx.core as mx

from mlxq.engine.engine import Engine, EngineConfig
from mlxq.engine.types import FinishReason, Request, SamplingParams
from mlxq.models.loader import load_model

POISON = 7  # a prompt containing this token id makes the wrapped model raise


class PoisonedModel:
    """The real model, except that it raises on prompts holding POISON (a real engine fault)."""

    def __init__(self, model):
        self._model = model

    def __call__(self, inputs, cache=None, **kw):
        if inputs.size > 1 and bool(mx.any(inputs == POISON).item()):
            raise RuntimeError("injected fault")
        return self._model(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def start_engine(model_dir, poisoned=False) -> Engine:
    def load():
        loaded = load_model(str(model_dir))
        if poisoned:
            loaded.model = PoisonedModel(loaded.model)
        return loaded

    engine = Engine(load, EngineConfig())
    engine.start()
    assert engine.ready.wait(60)
    return engine


def run(engine: Engine, request: Request) -> list:
    events: queue.Queue = queue.Queue()
    engine.submit(request, events.put)
    out = []
    while True:
        event = events.get(timeout=60)
        out.append(event)
        if event.finish_reason is not None:
            return out


def test_exception_fails_only_that_request(tiny_model_dirs):
    engine = start_engine(tiny_model_dirs["llama"], poisoned=True)
    try:
        bad = run(engine, Request("bad", [1, 2, POISON, 3], SamplingParams(), 8))
        assert bad[-1].finish_reason is FinishReason.ERROR
        assert "injected fault" in bad[-1].error
        good = run(engine, Request("good", [1, 2, 3], SamplingParams(), 8))
        assert good[-1].finish_reason is FinishReason.LENGTH
        assert good[-1].usage.completion_tokens == 8
        assert engine.is_alive and engine.stats.requests_failed == 1
    finally:
        engine.stop(10)


def test_cancel_stops_generation_within_a_step(tiny_model_dirs):
    engine = start_engine(tiny_model_dirs["llama"])
    try:
        request = Request("long", [1, 2, 3], SamplingParams(), 4000, ignore_eos=True)
        events: queue.Queue = queue.Queue()
        seen = threading.Event()

        def emit(event):
            events.put(event)
            if event.token_id is not None:
                seen.set()

        engine.submit(request, emit)
        assert seen.wait(30)
        request.cancel()
        while (event := events.get(timeout=30)).finish_reason is None:
            pass
        assert event.finish_reason is FinishReason.CANCELLED
        assert event.usage.completion_tokens < 4000
        # The engine moves on to the next request.
        assert run(engine, Request("next", [4, 5], SamplingParams(), 3))[-1].finish_reason is FinishReason.LENGTH
    finally:
        engine.stop(10)


def test_a_fault_in_a_shared_prefill_forward_fails_only_its_request(tiny_model_dirs):
    """Joiners prefilling together: when the shared forward raises, each is retried alone."""
    from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
    from mlxq.kv.projection import measure_footprint

    loaded = load_model(str(tiny_model_dirs["llama"]))
    model = PoisonedModel(loaded.model)
    finished = {}
    scheduler = BatchScheduler(model, loaded.tokenizer, measure_footprint(loaded.model),
                               SchedulerConfig(8, 4, 2048, None),
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output))
    bad_events: list = []
    scheduler.add(Request("bad", [1, 2, POISON, 3, 4, 5], SamplingParams(), 8), bad_events.append)
    scheduler.add(Request("good", [1, 2, 3, 4, 5, 6], SamplingParams(), 8, ignore_eos=True), lambda e: None)
    while not scheduler.is_idle:
        scheduler.step()
    assert finished["bad"].finished is FinishReason.ERROR and "injected fault" in bad_events[-1].error
    assert finished["good"].finished is FinishReason.LENGTH and len(finished["good"].tokens) == 8
    solo = run_serial_tokens(loaded, [1, 2, 3, 4, 5, 6])
    assert finished["good"].tokens == solo


def run_serial_tokens(loaded, prompt: list[int]) -> list[int]:
    from mlxq.engine.serial import run_serial

    request = Request("solo", prompt, SamplingParams(), 8, ignore_eos=True)
    return run_serial(loaded.model, loaded.tokenizer, request, lambda e: None, prefill_step_size=2048).tokens


def test_a_forwards_take_in_admits_plain_requests_and_leaves_the_rest_for_the_loop_in_order():
    """``Engine._take_in_meanwhile`` (a held burst's forward running): requests handed over are
    admitted while the scheduler takes them; from the first item that is not a plain request (a
    flush, a stop) everything waits, in order, for the loop's next intake; the loop's own intake then
    reads those first."""
    from mlxq.engine.engine import _Flush, _Work
    from mlxq.engine.gateway import Lane, Placement, RequestShape

    class Admitting:
        def __init__(self, room: int):
            self.room, self.added = room, []

        def can_admit(self, request) -> bool:
            return len(self.added) < self.room

        def add(self, request, emit, arrived=None) -> None:
            self.added.append(request.request_id)

    def work(name: str) -> _Work:
        request = Request(name, [1, 2, 3], SamplingParams(), 4)
        return _Work(request, lambda e: None, Placement(RequestShape.of(request), Lane.CONTINUOUS, "test"))

    engine = Engine(lambda: None, EngineConfig(max_rows=8))
    engine.scheduler = Admitting(room=3)
    flush = _Flush()
    for item in (work("a"), work("b"), flush, work("c"), None):
        engine._inbox.put(item)
    engine._take_in_meanwhile()
    assert engine.scheduler.added == ["a", "b"]
    assert engine._put_back == [flush, engine._put_back[1], None] and engine._put_back[1].request.request_id == "c"
    engine._take_in_meanwhile()  # something waits for the loop: nothing more is taken here
    assert engine.scheduler.added == ["a", "b"]
    engine._inbox.put(work("d"))
    taken = engine._drain_inbox(block=True, timeout=0.01)
    assert [getattr(getattr(t, "request", None), "request_id", t) for t in taken] == [flush, "c", None]
    assert engine._put_back == [] and engine._inbox.qsize() == 1  # "d" after the stop: not read
