"""The serial lane under memory pressure: retry once, then requeue, and resume exactly where it stopped.

mlx-lm's ``generate_step`` runs the serial lane, so an allocation failure
inside it ends the generator: there is no step left to evaluate again.
Recovery is at the request's level instead. Its KV is dropped (the caches
hold the failed step's graph) and recomputed from its tokens, the prompt
plus every token already handed out, by a new ``generate_step`` over that
sequence; the request's output (text, stop-string state, counts, usage)
carries on, so nothing is emitted twice and the next token is the one an
undisturbed run would draw next:

- the first failure releases MLX's cache and resumes at once (the retry);
- a second one before a new token was handed out requeues the request at
  the head of the engine's FIFO, after a short back-off (``requeue_delay``);
  after MAX_PREEMPTIONS requeues it fails with an out-of-memory error.

Logits processors are stateless functions of the token history and see the
whole sequence again; a grammar's matcher consumes the tokens it has not
seen (GrammarState.resume). Seeded sampling draws from MLX's global key
(mlx-lm's samplers), which Python cannot set to a given key; it can be
replayed: seed again, then advance the key once per draw already made (one
per token; two with XTC, whose hidden draw uses the same key). The key
before the first draw to be redone is recorded and the replay is checked
against it: a mismatch fails the request clearly instead of diverging.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlxq.engine.grammar import GrammarState
from mlxq.engine.output import RequestOutput
from mlxq.engine.preempt import MAX_PREEMPTIONS
from mlxq.engine.types import Request

FIRST_DELAY_S = 0.05  # back-off before the first requeued resume; doubles per requeue
MAX_DELAY_S = 2.0


def requeue_delay(times_requeued: int) -> float:
    """Seconds a requeued serial request waits before it resumes (memory others hold may be freed)."""
    return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** max(0, times_requeued - 1))


class DrawLedger:
    """Where a seeded request's draws stand on MLX's global key, so a resume can replay it.

    ``before_draw`` runs just before each draw (from the sampler); ``key_before(n)`` is the
    global key as it was before draw n, for the first draw not yet handed out."""

    def __init__(self, seed: int, per_draw: int):
        self.seed = seed
        self.per_draw = per_draw  # global-key advances per draw (categorical; + XTC's uniform)
        self.first = 0  # draw index of keys[0]
        self.keys: list[mx.array] = []

    def before_draw(self, index: int) -> None:
        del self.keys[index - self.first :]  # draws of a failed attempt are redone
        self.keys.append(mx.random.state[0])

    def handed_out(self, n: int) -> None:
        """Tokens 0..n-1 are out: their draws never run again."""
        drop = min(max(0, n - self.first), len(self.keys))
        del self.keys[:drop]
        self.first += drop

    def key_before(self, n: int) -> mx.array:
        i = n - self.first
        return self.keys[i] if 0 <= i < len(self.keys) else mx.random.state[0]  # draw n never started

    def replay(self, n: int, expected: mx.array) -> None:
        """Set the global key to where it stood before draw n; raise if that is not ``expected``."""
        mx.random.seed(self.seed)
        for _ in range(n * self.per_draw):
            mx.random.uniform(shape=(0,))  # one global-key advance, no data
        if not mx.array_equal(mx.random.state[0], expected).item():
            raise InexactResume(f"seeded sampling could not be replayed to draw {n} after a memory fault")


class InexactResume(RuntimeError):
    """A seeded request's key sequence could not be restored: failing beats silently diverging."""


@dataclass
class SerialRun:
    """One serial request's state across attempts: what it handed out and how it draws next."""

    request: Request
    output: RequestOutput
    sampler: Callable  # mlx-lm's sampler for the request
    processors: list  # mlx-lm's logits processors (stateless: they see the whole token history)
    grammar: GrammarState | None = None
    draws: DrawLedger | None = None  # seeded sampled requests only
    retrying: bool = False  # a fault happened and no token was handed out since
    times_requeued: int = 0
    not_before: float = 0.0  # monotonic time before which a requeued run does not resume
    resume_key: mx.array | None = field(default=None, repr=False)  # the key before the next draw
    last_draw: mx.array | None = field(default=None, repr=False)  # the sampler's latest token (maybe pending)
    checkpoint: object | None = None  # engine.checkpointing.RowCheckpoint when the request is checkpointed
    restored: list | None = field(default=None, repr=False)  # a checkpoint's caches, for the next attempt

    @property
    def sequence(self) -> list[int]:
        """What the next attempt prefills: the prompt, then every token handed out."""
        return self.request.prompt_ids + self.output.tokens

    def prepare_resume(self) -> None:
        """After a fault: remember the key before the next draw (others may move the global key)."""
        if self.draws is not None:
            self.resume_key = self.draws.key_before(self.output.num_generated)
            mx.eval(self.resume_key)

    def restore(self) -> None:
        """Before an attempt that resumes: global key, grammar matcher, as before the next draw."""
        if self.draws is not None and self.resume_key is not None:
            self.draws.replay(self.output.num_generated, self.resume_key)
        if self.grammar is not None:
            self.grammar.resume(self.output.tokens)

    def requeue(self) -> bool:
        """Requeue after a failed retry; False when it was requeued too often (it cannot fit)."""
        if self.times_requeued >= MAX_PREEMPTIONS:
            return False
        self.times_requeued += 1
        self.not_before = time.monotonic() + requeue_delay(self.times_requeued)
        return True


class SerialPreempted(Exception):
    """The retry failed too: the engine requeues ``run`` at the head of its FIFO."""

    def __init__(self, run: SerialRun):
        super().__init__(f"request {run.request.request_id} requeued after a memory fault")
        self.run = run


def backing_off(run: SerialRun | None) -> bool:
    """A requeued run still waiting out its back-off (sleeps a moment so the engine loop does not spin)."""
    if run is None:
        return False
    wait = run.not_before - time.monotonic()
    if wait <= 0:
        return False
    time.sleep(min(wait, 0.01))
    return True
