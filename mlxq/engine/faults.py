"""Allocation faults: recognise them, retry an evaluation once, and inject them for tests.

MLX raises a plain ``RuntimeError`` when the device cannot allocate:

- CUDA: ``cudaMallocAsync(&data, size, stream) failed: out of memory``
  (mlx/backend/cuda/allocator.cpp through ``check_cuda_error``);
- Metal: ``[metal::malloc] Attempting to allocate N bytes which is greater than
  the maximum allowed buffer size`` or ``[metal::malloc] Resource limit (...) exceeded``;
- any backend: ``[malloc] Unable to allocate N bytes.``;
- cuBLAS / cuDNN workspaces: ``..._STATUS_ALLOC_FAILED``.

MLX's ``eval`` leaves the graph whole when a primitive throws (arrays evaluated
before the failure stay evaluated, the failed one and everything after it stay
unscheduled with their inputs), so evaluating the same arrays again after
``mx.clear_cache()`` resumes the step exactly where it stopped: nothing is
rebuilt, and no sampler state moves twice.

``MLXQ_FAULT_INJECT`` raises that same exception at chosen evaluation attempts,
so the recovery path runs on any machine: ``decode:3`` fails the 3rd decode
evaluation, ``decode:3-4`` the 3rd and the 4th (its retry, which forces a
preemption), ``prefill:2`` the 2nd prefill evaluation; sites are ``decode``,
``prefill``, ``token0`` and ``checkpoint`` (the batch lane's staging of
checkpoint copies: the link is dropped, the rows go on); entries are
comma-separated. The serial lane,
whose evaluations run inside mlx-lm's loop, checks the same sites at each
prefill chunk, the first draw of each loop and every later draw.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("mlxq.faults")

FAULT_ENV = "MLXQ_FAULT_INJECT"
SITES = ("decode", "prefill", "token0", "checkpoint")
_MEMORY_MARKERS = ("out of memory", "[malloc]", "[metal::malloc]", "unable to allocate", "alloc_failed")


class MemoryFault(RuntimeError):
    """An allocation failed twice in a row at one evaluation: the caller must shed work."""

    def __init__(self, site: str, cause: BaseException):
        super().__init__(f"{site}: {cause}")
        self.site = site
        self.cause = cause


def is_allocation_failure(exc: BaseException) -> bool:
    """The device ran out of memory (MLX's own messages, on CUDA, Metal and the CPU)."""
    if isinstance(exc, MemoryFault):
        return True
    if not isinstance(exc, (RuntimeError, MemoryError)):
        return False
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or any(marker in text for marker in _MEMORY_MARKERS)


def parse_fault_spec(spec: str) -> dict[str, frozenset[int]]:
    """``"decode:3-4,prefill:2"`` -> {"decode": {3, 4}, "prefill": {2}} (1-based attempt numbers)."""
    plan: dict[str, set[int]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        site, sep, when = entry.partition(":")
        if not sep or site not in SITES:
            raise ValueError(f"{FAULT_ENV}: {entry!r} is not SITE:N or SITE:N-M with SITE one of {SITES}")
        first, _, last = when.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: {entry!r}: attempts are integers") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"{FAULT_ENV}: {entry!r}: attempts count from 1, N <= M")
        plan.setdefault(site, set()).update(range(lo, hi + 1))
    return {site: frozenset(attempts) for site, attempts in plan.items()}


@dataclass
class FaultInjector:
    """Counts evaluation attempts per site and raises MLX's CUDA allocation error at the planned ones."""

    plan: dict[str, frozenset[int]] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    injected: int = 0

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(parse_fault_spec(os.environ.get(FAULT_ENV, "")))

    def check(self, site: str) -> None:
        if not self.plan:
            return
        n = self.attempts[site] = self.attempts.get(site, 0) + 1
        if n in self.plan.get(site, ()):
            self.injected += 1
            raise RuntimeError(f"cudaMallocAsync(&data, size, stream) failed: out of memory "
                               f"(injected by {FAULT_ENV} at {site} attempt {n})")


@dataclass
class FaultCounters:
    """What /stats and /metrics report (engine thread writes; readers take ints)."""

    memory_faults: int = 0  # allocation failures seen at an evaluation
    retried_ok: int = 0  # of those, evaluations that succeeded on the retry
    preemptions: int = 0  # rows whose KV was dropped and who were requeued to be recomputed
    failed_out_of_memory: int = 0  # rows that could not run even alone, after repeated preemption


class Evaluator:
    """``run(site, fn)``: evaluate, and on an allocation failure release MLX's cache and try once more."""

    def __init__(self, injector: FaultInjector | None = None):
        self.injector = injector or FaultInjector()
        self.counters = FaultCounters()

    def run(self, site: str, evaluate: Callable[[], object]) -> object:
        try:
            self.injector.check(site)
            return evaluate()
        except Exception as exc:
            if not is_allocation_failure(exc):
                raise
            self.counters.memory_faults += 1
            log.warning("allocation failed at %s (%s); releasing cached memory and retrying once", site, exc)
        release_cached_memory()
        try:
            self.injector.check(site)
            result = evaluate()
        except Exception as exc:
            if not is_allocation_failure(exc):
                raise
            self.counters.memory_faults += 1
            release_cached_memory()
            raise MemoryFault(site, exc) from exc
        self.counters.retried_ok += 1
        return result


def release_cached_memory() -> None:
    """Hand MLX's cached buffers back to the device (best effort: never turn one fault into two)."""
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:
        log.debug("clear_cache after a fault failed", exc_info=True)
