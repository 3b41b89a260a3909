"""Tensor parallel: every rank runs the same engine loop; rank 0 decides what enters it.

Each rank holds a shard of the weights and of every KV cache, so each must
make exactly the calls rank 0 makes: the same rows admitted, prefilled,
merged, cached and evicted in the same order. The engine is deterministic
given what enters it, so rank 0 shares, once per loop iteration, everything
that does not come from the engine itself: the requests it took from its
inbox (token ids and parameters, never text), the requests cancelled since,
and whether to stop. Sampling needs no sharing: the last layer's all_sum hands
every rank the same hidden state, so logits, and draws from the same PRNG
state, are the same everywhere.

Cancellation is the one flag the HTTP side sets at any moment; on rank 0 the
engine works on a copy of each request whose flag is set only here, at the
iteration boundary, when every rank sets it too.

Each iteration also gathers a digest of every rank's engine state (queue,
rows, tokens generated); ranks that drifted apart fail loudly instead of
deadlocking in a collective later.

That gather is the one collective of an iteration with nothing new (with
news, rank 0's message follows it), and every collective is read one
iteration after it is queued, so the host never waits for the decode step
in flight: what rank 0 shares enters every rank two iterations after rank 0
took it.

An idle server's ranks do not wait in that gather (MLX's ring backend polls while it waits): once
every rank reported itself idle and nothing is on its way, every rank leaves the next iteration
until rank 0 wakes them over a plain blocking channel (distributed/wake.py): when work arrives, or
at rank 0's idle heartbeat, which keeps a lost or hung rank detected while nothing runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxq.distributed.channel import agree_min, gather_ints, share_bytes, start_gather, start_share_sized
from mlxq.distributed.wake import WakeChannel, open_wake_channel
from mlxq.distributed.world import RankInfo, World
from mlxq.engine.output import EmitFn
from mlxq.engine.types import FinishReason, Request, TokenEvent
from mlxq.store.rank_restore import NOT_DURABLE, WRITING

log = logging.getLogger("mlxq.engine")

DIGEST_NAMES = ("waiting", "rows", "prefilling", "generated_tokens", "token checksum")
_CHECKSUM_MOD = (1 << 61) - 1  # a prime: every token id and its position move the checksum
_NOT_SHARED = ("cancelled", "submitted_at", "received_at", "read_at")  # a flag set here, and times on this rank's clock
# A gathered row ends with: whether the rank is quiet, its SSD flush state, its MLX active and peak bytes.
_QUIET, _SSD, _ACTIVE, _PEAK = -4, -3, -2, -1


class RanksDisagree(ValueError):
    """Ranks were started with a different model, flags or world size."""


@dataclass
class Arrivals:
    """What one iteration adds to every rank's engine."""

    requests: list[tuple[Request, EmitFn]] = field(default_factory=list)  # followers: rank 0's, rebuilt here
    stop: bool = False
    flush: bool = False  # rank 0 was asked to put the SSD tier's dirty entries on disk: every rank does
    taken_at: int = 0  # the iteration rank 0 took this news at (0: no news)


@dataclass
class _Open:
    original: Request  # the HTTP side's request (rank 0), whose flag clients set
    copy: Request  # what the engine runs
    emit: EmitFn
    shared: bool = False  # sent to the other ranks
    cancel_shared: bool = False


def _spec(request: Request) -> dict:
    return {f.name: getattr(request, f.name) for f in dataclasses.fields(Request) if f.name not in _NOT_SHARED}


@dataclass
class _InFlight:
    rows: Callable[[], list[list[int]]]  # reads the gather (channel.start_gather)
    payload: bytes  # rank 0's message for its iteration (b"": nothing new; always b"" on other ranks)
    iteration: int


@dataclass
class _Message:
    read: Callable[[], bytes]  # rank 0's message (channel.start_share_sized)
    taken_at: int  # the iteration rank 0 took its news at


class Lockstep:
    """One per rank. Rank 0's HTTP threads call :meth:`track`; the engine thread calls the rest."""

    def __init__(self, world: World, idle_heartbeat_s: float = 1.0):
        self.world = world
        self.idle_heartbeat_s = idle_heartbeat_s  # rank 0 idle: how long it sleeps before an iteration anyway
        self.wake: WakeChannel | None = None  # after start-up; None: idle ranks wait in the collective
        self._sleep_due = False  # every rank reported itself idle with nothing on its way: sleep next
        self._woken_for_work = False  # this iteration's sleep ended with work on rank 0: no sleep at the next
        self.sleeps = 0
        self.ranks: list[RankInfo] = []  # every rank, after start-up
        self.rank_memory: list[tuple[int, int]] = []  # (active, peak) bytes per rank, as of the last iteration
        self.rank_ssd: list[int] = []  # per rank, as of the last iteration: store.rank_restore.flush_state
        self._flush_shared_at = 0  # the iteration that last shared a flush
        self.failure: str | None = None  # why serving stopped (a rank lost), for /health
        self.iterations = 0
        self.exchange_s = 0.0  # wall time in exchange()
        self.collectives = 0  # the exchange's: one gather per iteration, one more per iteration with news
        self._in_flight: _InFlight | None = None  # this iteration's gather, read at the next one
        self._message: _Message | None = None  # rank 0's message, queued at this iteration, read at the next
        self._state_iteration = 0  # the iteration rank_memory and rank_ssd were gathered at
        self._token_checksum = 0  # every token this rank handed out, in order: ranks that sampled apart differ
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    # --- start-up (engine thread, every rank) ---------------------------------------
    @staticmethod
    def one_stream() -> None:
        """Every MLX op of the engine thread on mlx-lm's generation stream, collectives included.

        Forwards run on that stream and on the default one; two streams evaluate concurrently, so
        their all_sums could interleave on the wire differently on each rank (seen on the ring backend:
        one rank's digest read another's activations). One stream keeps every rank's order the same."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):  # a per-thread stream: this thread's own
            stream = mx.default_stream(mx.default_device())
        mx.set_default_stream(stream)

    def agree(self, identity: dict) -> None:
        """Refuse to serve unless every rank was started like rank 0 (model, flags, world size)."""
        group = self.world.group
        mine = json.dumps(identity, sort_keys=True, default=str).encode()
        views = [json.loads(share_bytes(group, mine, root=r)) for r in range(self.world.size)]
        for rank, view in enumerate(views[1:], start=1):
            differ = sorted(k for k in set(view) | set(views[0]) if view.get(k) != views[0].get(k))
            if differ:
                details = "; ".join(f"{k}: rank 0 {views[0].get(k)!r}, rank {rank} {view.get(k)!r}" for k in differ)
                raise RanksDisagree(f"rank {rank} was started differently from rank 0 ({details})")

    def after_load(self) -> None:
        """One PRNG state on every rank (unseeded sampling draws alike) and the rank layout."""
        import mlx.core as mx

        group = self.world.group
        seed = int.from_bytes(share_bytes(group, secrets.token_bytes(8)), "little")
        mx.random.seed(seed)
        info = json.dumps(dataclasses.asdict(self.world.local_info())).encode()
        self.ranks = [RankInfo(**json.loads(share_bytes(group, info, root=r))) for r in range(self.world.size)]
        self.wake = open_wake_channel(group, local=all(r.host == self.ranks[0].host for r in self.ranks))

    def agree_min(self, value: int | None) -> int | None:
        return agree_min(self.world.group, value)

    def gather_one(self, value: int) -> list[int]:
        """Every rank's ``value``, by rank (a collective: every rank calls it at the same point)."""
        return [row[0] for row in gather_ints(self.world.group, [int(value)])]

    @property
    def others_flushed(self) -> bool:
        """Every other rank had taken the flush and had no SSD write left, as of the last gather read."""
        return self._state_iteration > self._flush_shared_at and WRITING not in self.rank_ssd[1:]

    @property
    def others_durable(self) -> bool:
        return NOT_DURABLE not in self.rank_ssd[1:]

    def from_leader(self, value):
        """Rank 0's ``value`` on every rank: sizes every rank must plan alike (under pipeline parallelism
        each rank holds other layers; rank 0 holds the most, so its sizes are the safe ones)."""
        return pickle.loads(share_bytes(self.world.group, pickle.dumps(value)))

    # --- rank 0, any thread -----------------------------------------------------------
    def track(self, request: Request, emit: EmitFn) -> tuple[Request, EmitFn]:
        """The engine's copy of ``request`` and an ``emit`` that stops after the request's last event."""
        copy = dataclasses.replace(request, cancelled=threading.Event())
        with self._lock:
            self._open[request.request_id] = _Open(request, copy, emit)
        return copy, self._once(request.request_id, emit)

    def _once(self, request_id: str, emit: EmitFn) -> EmitFn:
        def emit_until_finished(event: TokenEvent) -> None:
            if event.token_id is not None:  # the engine thread: in the same order on every rank
                self._token_checksum = (self._token_checksum * 1_000_003 + event.token_id + 1) % _CHECKSUM_MOD
            with self._lock:
                if request_id not in self._open:
                    return  # finished already, or failed by fail_open
                if event.finish_reason is not None:
                    del self._open[request_id]
            emit(event)

        return emit_until_finished

    def fail_open(self, message: str) -> int:
        """End every open request with an error (the engine may be stuck in a collective); how many."""
        with self._lock:
            self.failure = message
            opened, self._open = list(self._open.values()), {}
        for entry in opened:
            entry.emit(TokenEvent(entry.original.request_id, finish_reason=FinishReason.ERROR, error=message))
        return len(opened)

    # --- the engine thread, every rank, once per loop iteration ---------------------------
    def exchange(self, taken: list[Request], stop: bool, digest: list[int], flush: bool = False,
                 ssd_state: int = 0, quiet: bool = False) -> Arrivals:
        """Queue this iteration's gather (rank 0's news: the size of its message; every rank's ``digest``,
        the checksum of the tokens it handed out, whether it is ``quiet`` (idle, no background work) and
        its ``ssd_state``, store.rank_restore.flush_state);
        read the last iteration's (check the digests match rank 0's; with news, queue rank 0's message);
        and return the message queued at the last iteration (its requests, cancellations, flush and stop),
        on every rank at this iteration.

        Each collective is read one iteration after it is queued, which keeps the decode pipeline full:
        queued before the decode step of its own iteration, it is complete by the next one, so the read
        does not wait for the step in flight (a read in the same iteration would: one stream). So what
        rank 0 takes enters every rank two iterations later (``Arrivals.taken_at`` says when it was
        taken); rank 0's engine holds its own work until then."""
        self.iterations += 1
        started = time.perf_counter()
        try:
            return self._exchange(taken, stop, digest, flush, ssd_state, quiet)
        finally:
            self.exchange_s += time.perf_counter() - started

    @property
    def news_in_flight(self) -> bool:
        """Rank 0's news is on its way to every rank: the next iterations must not wait for more."""
        return self._message is not None or (self._in_flight is not None and bool(self._in_flight.payload))

    def _exchange(self, taken: list[Request], stop: bool, digest: list[int], flush: bool, ssd: int,
                  quiet: bool) -> Arrivals:
        import mlx.core as mx

        payload = self._payload(taken, stop, flush) if self.world.is_leader else b""
        arrivals = self._take_message()
        if arrivals.stop:  # every rank stops at this iteration: nothing more to share
            return arrivals
        header, self._in_flight = self._in_flight, None
        if header is not None:
            self._read_header(header, news_taken=arrivals.taken_at > 0)
        values = [len(payload), *digest, self._token_checksum, int(quiet), ssd, mx.get_active_memory(),
                  mx.get_peak_memory()]
        self._in_flight = _InFlight(start_gather(self.world.group, values), payload, self.iterations)
        self.collectives += 1
        return arrivals

    def _read_header(self, header: _InFlight, news_taken: bool) -> None:
        """The last iteration's gather: every rank's state, and the size of rank 0's message, queued now.
        Every rank quiet then, no message this iteration or next and no work taken in this iteration's sleep:
        every rank sleeps at the next one."""
        rows = header.rows()
        self._sleep_due = (self.wake is not None and not news_taken and not self._woken_for_work
                           and rows[0][0] == 0 and all(row[_QUIET] for row in rows))
        self.rank_memory = [(row[_ACTIVE], row[_PEAK]) for row in rows]
        self.rank_ssd = [row[_SSD] for row in rows]
        self._state_iteration = header.iteration
        self._check_digests(rows, header.iteration)
        size = rows[0][0]
        if size:
            self._message = _Message(start_share_sized(self.world.group, header.payload, size), header.iteration)
            self.collectives += 1

    def idle_wait(self, drain: Callable[[float], list], poll_s: float) -> list:
        """Rank 0's intake at the start of an iteration (``drain(timeout)``: what it took; [] elsewhere).
        Where every rank agreed to sleep, rank 0 waits for work up to its heartbeat, then wakes the other
        ranks, which wait here without spinning; elsewhere rank 0 waits up to ``poll_s``, as alone."""
        due, self._sleep_due, self._woken_for_work = self._sleep_due, False, False
        if not due:
            return drain(poll_s)
        self.sleeps += 1
        if not self.world.is_leader:
            self._woken_for_work = self.wake.wait()
            return []
        taken = drain(self.idle_heartbeat_s)
        self._woken_for_work = bool(taken)
        self.wake.wake_all(work=self._woken_for_work)
        return taken

    def _take_message(self) -> Arrivals:
        message, self._message = self._message, None
        if message is None:
            return Arrivals()
        shared = pickle.loads(message.read())  # rank 0's own bytes: trusted
        if shared["flush"]:
            self._flush_shared_at = self.iterations
        arrivals = Arrivals(stop=shared["stop"], flush=shared["flush"], taken_at=message.taken_at)
        if not self.world.is_leader:
            for spec in shared["arrivals"]:
                request = Request(**spec)
                self._open[request.request_id] = _Open(request, request, _discard)
                arrivals.requests.append((request, self._once(request.request_id, _discard)))
        self._apply_cancels(shared["cancels"])
        return arrivals

    def _payload(self, taken: list[Request], stop: bool, flush: bool = False) -> bytes:
        with self._lock:
            cancels = []
            for entry in self._open.values():
                if entry.shared and not entry.cancel_shared and entry.original.cancelled.is_set():
                    entry.cancel_shared = True
                    cancels.append(entry.copy.request_id)
            for request in taken:
                if request.request_id in self._open:
                    self._open[request.request_id].shared = True
        if not taken and not cancels and not stop and not flush:
            return b""
        return pickle.dumps({"arrivals": [_spec(r) for r in taken], "cancels": cancels, "stop": stop,
                             "flush": flush})

    def _apply_cancels(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                entry = self._open.get(request_id)
                if entry is not None:
                    entry.copy.cancel()

    def _check_digests(self, rows: list[list[int]], iteration: int) -> None:
        width = len(DIGEST_NAMES)
        leader = rows[0][1:1 + width]
        for rank, row in enumerate(rows[1:], start=1):
            theirs = row[1:1 + width]
            if theirs != leader:
                seen = ", ".join(f"{n} {a} vs {b}" for n, a, b in zip(DIGEST_NAMES, leader, theirs, strict=True))
                raise RuntimeError(f"rank {rank} diverged from rank 0 at iteration {iteration} ({seen})")

    def _per_iteration(self, total: float) -> float:
        return round(total / self.iterations, 3) if self.iterations else 0

    def as_dict(self) -> dict:
        """/stats.distributed."""
        return {
            "world_size": self.world.size,
            "rank": self.world.rank,
            "backend": self.world.backend,
            "mode": self.world.mode,
            "iterations": self.iterations,
            # per iteration: queuing this iteration's collectives and reading the last iteration's
            "exchange_ms_per_iteration": self._per_iteration(1e3 * self.exchange_s),
            "collectives_per_iteration": self._per_iteration(self.collectives),
            "idle_wait": "wake channel" if self.wake is not None else "collective",  # how idle ranks wait
            "idle_sleeps": self.sleeps,  # iterations every rank started by sleeping until rank 0 woke it
            "totals": {"exchange_s": self.exchange_s, "collectives": self.collectives},
            "failure": self.failure,
            "ranks": [{**dataclasses.asdict(info),
                       "mlx_active_bytes": self.rank_memory[info.rank][0] if self.rank_memory else None,
                       "mlx_peak_bytes": self.rank_memory[info.rank][1] if self.rank_memory else None}
                      for info in self.ranks],
        }


def _discard(event: TokenEvent) -> None:
    """A follower's output goes nowhere: rank 0 answers the clients."""

