"""Work another thread hands the engine thread, run between two steps: what changes the model's modules.

The engine thread owns the model: a forward reads its layers while it runs,
and the serial lane keeps one adapter routing across a whole request. A
call is queued in the engine's inbox and runs when the engine loop stands
between iterations (never inside a serial request's generation), so no step
is in flight on the modules it replaces. The asking thread waits for the
result; a call still queued when its caller stops waiting never runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


class EngineCallTimeout(TimeoutError):
    """The engine did not reach a point between steps in time; the call was withdrawn, nothing changed."""


@dataclass
class EngineCall:
    fn: Callable[[], object]
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _state: str = "queued"  # queued -> running -> done, or queued -> withdrawn

    def run(self) -> None:
        """Engine thread: run it unless its caller gave up waiting."""
        with self._lock:
            if self._state != "queued":
                return
            self._state = "running"
        try:
            self.result = self.fn()
        except Exception as exc:  # handed to the caller, who raises it
            self.error = exc
        finally:
            self._state = "done"
            self.done.set()

    def wait(self, timeout: float) -> object:
        """Caller's thread: the result (or the call's exception); EngineCallTimeout when it never started."""
        if not self.done.wait(timeout):
            with self._lock:
                if self._state == "queued":
                    self._state = "withdrawn"
                    raise EngineCallTimeout(f"the engine did not take the call within {timeout:g} s")
            self.done.wait()  # it started: its change is made whole before the caller hears of it
        if self.error is not None:
            raise self.error
        return self.result
