"""The batch lane's prefill phase: joiners advance one chunk each, as the step plan says.

A mixin of BatchScheduler (engine/scheduler.py): ``_prefill`` carries out a
``PrefillPlan`` (engine/step_plan.py). A joiner prefills prompt[:-1] on its
own solo caches in the serial lane's chunks (``--prefill-step-size``, cut
where the prefix policy snapshots: store/prefix.py); when several advance in
one step their chunks run as one forward: rows on plain full-attention
caches (and tails on a shared prefix) placed where their left-padded chunks
end together, every row's stored prefix gathered in one operation per layer
(engine/tail_placement.py, engine/prefix_gather.py); others merged with the
chunks right-padded (mlx-lm's ``prepare``/``finalize``); then each row is
extracted again, or the batch kept for their join.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache

from mlxq.engine.faults import MemoryFault
from mlxq.engine.joiners import Joiner
from mlxq.engine.preempt import split_prefill_group
from mlxq.engine.prefix_gather import Piece, RowPrefix, own_piece
from mlxq.engine.shared_tails import evaluable
from mlxq.engine.step_plan import PrefillPlan
from mlxq.engine.step_sampling import sample_step
from mlxq.engine.tail_placement import PlacedRows, can_place, merge_for_tails, submitted_by_layers, tails_in_place
from mlxq.engine.wave_caches import PrefilledTogether, finalize_chunks, merge_with_room, same_as_previous
from mlxq.kv import packed_tails
from mlxq.kv.batch_ops import extract_row, view_rows
from mlxq.kv.packed_tails import PackedTailsCache, Packing, packed_positions
from mlxq.models.multi_lora import adapter_rows
from mlxq.store.prefix import boundary_snapshot, system_snapshot

log = logging.getLogger("mlxq.scheduler")
# A held burst's forward admits what arrives while it runs (``Prefilling._meanwhile``): the engine thread takes
# in arrivals this often, up to this share of the forward's expected time. MLXQ_BURST_MEANWHILE=0 turns it off
# (an A/B lever).
MEANWHILE = os.environ.get("MLXQ_BURST_MEANWHILE", "1") != "0"
MEANWHILE_POLL_S = 0.003
MEANWHILE_SHARE = 0.8
# Token 0 of joiners whose tails run placed on a shared prefix (on a GPU: token 0 in the decode step) drawn from
# that forward's last position, the last prompt token run with the tails, instead of from a decode step after the
# join (``Prefilling._tails_token0``; on the H200 a cached 64-agent burst's `first` phase, 22-33 ms, went).
# MLXQ_TAILS_TOKEN0=0 turns it off (an A/B lever).
TOKEN0_IN_TAILS = os.environ.get("MLXQ_TAILS_TOKEN0", "1") != "0"


def _plain_spans(node) -> bool:
    """Every layer of the node a plain (keys, values) span: what the gather reads (not quantized)."""
    return all(span is not None and isinstance(span[0], mx.array) for span in node.spans)


class Prefilling:
    """Joiners' chunks (mixed into BatchScheduler)."""

    def _prefill(self, plan: PrefillPlan) -> None:
        restoring = [self.joiners[i] for i in plan.restore]
        group = [(self.joiners[i], n) for i, n in zip(plan.advance, plan.chunks, strict=True)]
        for joiner in restoring:
            self._restore_step(joiner)
        if not group:
            return
        for joiner, _ in group:
            joiner.row.output.phases.mark("prefill")
        start = time.perf_counter()
        alone = self._advance_together_or_fewer(group) if plan.together else group
        if alone:
            group = alone  # after a failed batched forward only these advance, one by one
        for joiner, n in alone:
            try:
                self._advance(joiner, n)
            except MemoryFault:
                self.caps.lower_rows(len(self.batch) + len(self.joiners) - 1)  # admit no more until it drains
                self.joiners.remove(joiner)  # its caches took part of the failed forward: start over
                self._requeue([joiner.row])
            except Exception as exc:
                self._fail_joiners([joiner], "prefill", exc)
        self.phases.add_prefill(time.perf_counter() - start)
        for joiner, _ in group:
            if joiner in self.joiners and joiner.is_prefilled:
                self._snapshot(joiner)

    def _advance_together_or_fewer(self, group: list[tuple[Joiner, int]]) -> list[tuple[Joiner, int]]:
        """One forward for the group; returns the joiners still to advance one by one (none on success)."""
        try:
            self._advance_together(group)
            return []
        except MemoryFault:
            # Their own caches are untouched (the batch was a merged copy): the newest sit out.
            keep, _ = split_prefill_group(len(group))
            log.warning("batched prefill of %d joiners out of memory; %d go on, one by one", len(group), keep)
            self.caps.lower_group(keep)
            self.caps.lower_rows(len(self.batch) + len(self.joiners))  # admit no more until it drains
            return group[:keep]
        except Exception:
            # Find the joiner at fault: each one alone (their caches are untouched until success).
            log.warning("batched prefill of %d joiners failed; retrying one by one", len(group), exc_info=True)
            return group

    def _restore_step(self, joiner: Joiner) -> None:
        """Read one more tensor of the joiner's prefix from disk; once all are in, start from there."""
        try:
            done = self.prompt_cache.cold.advance_restore(joiner.restore)
        except Exception:  # a restore never fails the request: it prefills instead
            log.exception("SSD restore failed; prefilling instead")
            self._abandon_restore(joiner)
            return
        if not done:
            return
        pending, joiner.restore = joiner.restore, None
        if pending.entry is None:
            return  # the file was bad (and is gone): prefill from what RAM gave
        lease = self.prompt_cache.lease_restored(joiner.row.request.namespace, pending.entry, pending.n, joiner.done)
        joiner.start_from_lease(self._hold(joiner.row, lease))  # it never advanced while it restored

    def _chunk_len(self, joiner: Joiner) -> int:
        """The next chunk: the serial lane's boundaries (mlx-lm generate_step), cut at a snapshot point.
        Worked out once per ``done`` and caches (a held burst's joiners are planned at every arrival)."""
        state = (joiner.done, joiner.caches_id)
        if joiner.next_chunk is not None and joiner.next_chunk[0] == state:
            return joiner.next_chunk[1]
        n = min(self.config.prefill_step_size, len(joiner.prompt) - 1 - joiner.done)
        split = self._split_at(joiner)
        n = n if split is None else min(n, split - joiner.done)
        joiner.next_chunk = (state, n)
        return n

    def _split_at(self, joiner: Joiner) -> int | None:
        """Where to stop a chunk for a system-prompt snapshot (the serial lane stops at the same place)."""
        if self.prompt_cache is None:
            return None
        return system_snapshot(len(joiner.prompt), joiner.row.request.snapshot_at, joiner.done,
                               joiner.trimmable)

    def _advance(self, joiner: Joiner, n: int) -> None:
        """One chunk of prompt[:-1] (``n`` tokens) on the joiner's own caches."""
        with mx.stream(generation_stream):
            chunk = mx.array(joiner.prompt[joiner.done : joiner.done + n])
            with adapter_rows(self.model, [joiner.row.request.adapter]):
                self.model(chunk[None], cache=joiner.caches)
            self.scheme.convert(joiner.caches)  # the serial lane's (mlx-lm's) conversion point
            self.faults.run("prefill", lambda: mx.eval([c.state for c in joiner.caches]))
        self._advanced(joiner, n)

    def _advance_together(self, planned: list[tuple[Joiner, int]]) -> None:
        """One planned chunk for each joiner from one forward, then back to solo caches.

        Rows on plain full-attention caches are placed where their chunks end
        together (engine/tail_placement.py), tails on a shared prefix alike
        (engine/shared_tails.py); others are merged right-aligned with
        the chunks right-padded (``_right_padded_forward``). Then each row is
        extracted, or, after every row's last chunk, the batch is kept for their
        join (engine/wave_caches.py).
        """
        group, lengths = [j for j, _ in planned], [n for _, n in planned]
        longest = max(lengths)
        chunks = [j.prompt[j.done : j.done + n] for j, n in zip(group, lengths, strict=True)]
        last = all(j.done + n >= len(j.prompt) - 1 for j, n in planned)  # they join next: keep the batch
        started = time.perf_counter()
        token0 = last and TOKEN0_IN_TAILS and self.config.token0_in_decode
        last_logits = None
        with mx.stream(generation_stream):
            sources = self._lease_sources(group)
            shared = self._shared_tails(group, [n + token0 for n in lengths]) if last else None
            placed = None if shared is not None else self._placed(group, lengths, last)
            fed = chunks  # each row's tokens in this forward, padded to the longest (left or right)
            packed = False  # the tails ran packed: the forward computed their tokens only, no padding
            if placed is not None:  # every row written where it stays (engine/tail_placement.py)
                caches, layout = placed
                self._placed_forward(group, caches, layout, chunks)
            elif shared is not None and shared.layout is not None:  # the tails placed alike
                caches = shared.caches
                run = [c + j.prompt[-1:] for c, j in zip(chunks, group, strict=True)] if token0 else chunks
                fed = shared.tokens(group, run)
                packed = packed_tails.packs(self.sharing.plan, [len(tokens) for tokens in fed])
                if packed:
                    out, packing = self._packed_forward(group, caches, shared.layout, fed, shared)
                    last_logits = out[packing.ends, 0, :] if token0 else None
                else:
                    out = self._placed_forward(group, caches, shared.layout, fed, shared)
                    last_logits = out[:, -1, :] if token0 else None  # left-padded: every row's last prompt token
            else:
                caches = shared.caches if shared is not None else merge_with_room(
                    [j.caches for j in group], longest + (BatchKVCache.step if last else 0), sources)
                self._right_padded_forward(group, caches, shared, chunks, lengths)
            tokens = sum(map(len, fed))
            computed = tokens if packed else len(fed) * max(map(len, fed))  # positions, padding included
            timed = self._meanwhile(caches, shared, computed, started)
            self.faults.run("prefill", lambda: mx.eval(evaluable(caches) + ([] if last_logits is None
                                                                             else [last_logits])))
            self.phases.add_batched_forward(tokens, computed)
            self.sharing_stats.tails_packed += packed
            if timed is not None:
                self._learn_forward(*timed)
            # Joining next: the rows stay in this batch, the joiners read views into it (no copy; placed
            # rows build theirs only if read); on a shared prefix their own caches (the prefix) are read
            # no more: they join with this batch.
            kept = PlacedRows(caches, layout) if last and placed is not None else None
            rows = (None if shared or kept else view_rows(caches, len(group)) if last
                    else [extract_row(caches, i) for i in range(len(group))])
        if not last:
            self.batch.copies.extracted += len(group)
        if placed is None and not shared:
            self.batch.copies.broadcast += same_as_previous(sources)
        for i, (joiner, n) in enumerate(zip(group, lengths, strict=True)):  # only once everything succeeded
            if kept is not None:
                joiner.read_row(kept, i)
            elif rows is not None:
                joiner.caches = rows[i]
            self._advanced(joiner, n)
        if last_logits is not None:  # after ``_advanced``: each row's history holds its prompt but the last
            try:
                shared = replace(shared, first=self._tails_token0(group, last_logits))
            except Exception as exc:  # their caches hold their last prompt token: no decode step can redo it
                self._fail_joiners(group, "first token", exc)
                return
        if last:
            self._prefilled_together = PrefilledTogether(tuple(group), caches, shared)

    def _tails_token0(self, group: list[Joiner], logits: mx.array) -> tuple:
        """(tokens [rows], per-row logprobs or None) drawn from the tails' forward's last position
        ``logits`` [rows, V] as a decode step draws them (``sample_step``: plain greedy rows in one
        argmax, others by their sampler, processors and grammar, fed their last prompt token),
        evaluated."""
        lasts = mx.array([j.prompt[-1] for j in group])
        start = lambda *arrays: self.faults.run("token0", lambda: mx.async_eval(*arrays))  # noqa: E731
        tokens, logprobs = sample_step([j.row for j in group], logits, lasts, start, self.grammar_timing)
        self.faults.run("token0", lambda: mx.eval(tokens, [lp for lp in logprobs if lp is not None]))
        return tokens, logprobs

    def _meanwhile(self, caches: list, shared, tokens: int, started: float) -> tuple | None:
        """While a held burst's tails' forward runs on the device (tails on a shared prefix, on a GPU:
        ``BurstHold.window_s``), admit what arrived meanwhile (``take_in_meanwhile``): until
        ``MEANWHILE_SHARE`` of the time this forward should take from ``started`` (its graph's
        building included), the engine thread takes in arrivals every ``MEANWHILE_POLL_S``, sleeping
        between. That time is the largest such forward's so far on a prefix of that size, scaled by
        query tokens (``_largest_forward``: fixed costs make smaller ones dearer per token, so the
        estimate errs short and the polling never outlasts the forward). The rest of a burst split by
        the hold's window is then admitted as this forward ends, not after it. Returns what
        ``_learn_forward`` keeps (None: not taken)."""
        if shared is None or not (MEANWHILE and self.config.burst.window_s > 0):
            return None
        self.faults.run("prefill", lambda: mx.async_eval(evaluable(caches)))  # on the device now, however built
        self._take_in()
        key = shared.group.prefix_length.bit_length()  # per power of two of the prefix: its attention's share
        largest = self._largest_forward.get(key)
        if largest is not None:
            until = started + MEANWHILE_SHARE * largest[1] * tokens / largest[0]
            while time.perf_counter() + MEANWHILE_POLL_S < until:
                time.sleep(MEANWHILE_POLL_S)
                self._take_in()
        return key, started, tokens

    def _take_in(self) -> None:
        """``take_in_meanwhile``; a failure there is logged and fails no row of the forward running."""
        try:
            self.take_in_meanwhile()
        except Exception:
            log.warning("taking in arrivals during a forward failed; they wait for the next step", exc_info=True)

    def _learn_forward(self, key: int, started: float, tokens: int) -> None:
        """After ``_meanwhile``'s forward was evaluated: kept when it is the largest on its key so far
        (query tokens, seconds from its start; a repeat of that size keeps the quicker)."""
        seconds = time.perf_counter() - started
        kept = self._largest_forward.get(key)
        if kept is None or tokens > kept[0] or (tokens == kept[0] and seconds < kept[1]):
            self._largest_forward[key] = (tokens, seconds)

    def _placed_forward(self, group: list[Joiner], caches: list, layout, chunks: list, shared=None) -> mx.array:
        """The chunks left-padded on caches laid out for them; the padding's K/V never written. On a
        shared prefix (``shared``) the layout is the tails' and the attention goes through its seam.
        Returns the forward's logits (lazy: computed only if read)."""
        tokens = mx.array([[0] * p + c for p, c in zip(layout.chunk_padding, chunks, strict=True)])
        with self._placed_contexts([j.row.request.adapter for j in group], caches, layout, shared):
            return self.model(tokens, cache=caches)

    @contextlib.contextmanager
    def _placed_contexts(self, adapters: list[str], caches: list, layout, shared):
        """What a placed forward runs in: the rows' adapters (one name per row of the model's input),
        the chunks' padding columns keeping what they hold, the attention through the shared-prefix
        seam (``shared``), every few layers handed to the device."""
        evaluate = lambda arrays: self.faults.run("prefill", lambda: mx.eval(arrays))  # noqa: E731
        written = [c.tail for c in caches] if shared is not None else caches
        # Tails that start empty (``shared.recomputed``): the padding columns lie in each row's left
        # padding, never read, so nothing is kept there and nothing is evaluated before the forward.
        keeping = (contextlib.nullcontext() if shared is not None and shared.recomputed is not None
                   else tails_in_place(written, layout, evaluate))
        submit = lambda arrays: self.faults.run("prefill", lambda: mx.async_eval(arrays))  # noqa: E731
        with (adapter_rows(self.model, adapters), keeping, self._routed(shared), submitted_by_layers(caches, submit)):
            yield

    def _packed_forward(self, group: list[Joiner], caches: list, layout, fed: list, shared) -> tuple:
        """``_placed_forward`` on a shared prefix with no padding (kv/packed_tails.py): each of the
        rows' tokens is one row of one position, every layer written into ``caches`` (the padded
        forward's) as the padded forward writes them. Returns (logits [tokens, 1, V], lazy; the
        ``Packing``)."""
        packing = Packing.of(layout.chunk_padding, [len(tokens) for tokens in fed])
        positions = packed_positions(caches[0], packing)
        packed = [PackedTailsCache(cache, packing, positions) for cache in caches]
        tokens = mx.array([[token] for row in fed for token in row])
        adapters = [j.row.request.adapter for j, row in zip(group, fed, strict=True) for _ in row]
        with self._placed_contexts(adapters, caches, layout, shared):
            return self.model(tokens, cache=packed), packing

    def _right_padded_forward(self, group: list[Joiner], caches: list, shared, chunks: list, lengths: list[int]):
        """mlx-lm's way: chunks right-padded, the caches told the real lengths (``prepare``/``finalize``, so
        padding never displaces a ring's tokens or a recurrent state), then every row moved by its padding."""
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if any(padding):
            for cache in caches:
                cache.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([c + [0] * (longest - len(c)) for c in chunks])
        with adapter_rows(self.model, [j.row.request.adapter for j in group]), self._routed(shared):
            self.model(tokens, cache=caches)
        if any(padding):
            for cache in caches:
                finalize_chunks(cache, padding)

    def _placed(self, group: list[Joiner], lengths: list[int], last: bool):
        """(caches, layout) with each row placed for its tail (engine/tail_placement.py), or None where
        the placement does not apply (a layer that is not plain full attention: a ring, a recurrent
        state, quantized KV)."""
        lent = [self._lease_prefix(j) for j in group]  # read from the stored spans: never built
        rows = [None if p is not None else j.caches for j, p in zip(group, lent, strict=True)]
        if not can_place(rows):
            return None
        prefixes = [p if p is not None else RowPrefix((own_piece(row),) if j.done else (), j.done)
                    for j, p, row in zip(group, lent, rows, strict=True)]
        return merge_for_tails(rows, lengths, BatchKVCache.step if last else 0, prefixes)

    def _lease_prefix(self, joiner: Joiner) -> RowPrefix | None:
        """The stored chain's spans a joiner holding exactly what its lease lent reads from (so the
        lease's own concatenation is never computed, and rows on one chain share its pieces), or None."""
        lease = self._leases.get(joiner.row.request.request_id)
        if lease is None or lease.node is None or not joiner.holds_lent(lease) or joiner.done != lease.cached:
            return None
        nodes = [n for n in lease.chain() if n.depth < lease.cached]
        if not nodes or not all(_plain_spans(n) for n in nodes):
            return None
        return RowPrefix(tuple(Piece(n.spans) for n in nodes), lease.cached)

    def _lease_sources(self, group: list[Joiner]) -> list:
        """Per joiner, (its lease's node, tokens) while it holds exactly what its lease lent (nothing of
        its own yet), else None: joiners with equal sources hold the same K/V (one stored chain)."""
        out = []
        for joiner in group:
            lease = self._leases.get(joiner.row.request.request_id)
            untouched = lease is not None and lease.node is not None and joiner.holds_lent(lease)
            out.append((id(lease.node), lease.cached) if untouched and joiner.done == lease.cached else None)
        return out

    def _advanced(self, joiner: Joiner, n: int) -> None:
        """Bookkeeping after a chunk: processor history, snapshot at a system-prompt end, allocator."""
        prompt = joiner.prompt
        split = self._split_at(joiner)
        joiner.row.feed_history(mx.array(prompt[joiner.done : joiner.done + n]))
        joiner.done += n
        if joiner.is_prefilled:
            joiner.row.output.phases.mark("prefilled")  # after the chunk's evaluation
        if split is not None and joiner.done == split:
            # The end of a shared system prompt: other agents start from this entry.
            self._store_and_hold(joiner, split)
        if n == self.config.prefill_step_size:
            # A long prompt: release the chunk's transient buffers (the serial lane does
            # the same). Short prompts skip it, so a burst of joiners does not make the
            # allocator give back and re-acquire the running batch's buffers each time.
            mx.clear_cache()

    def _snapshot(self, joiner: Joiner) -> None:
        """At the prompt boundary (all but the last token), store what the prefix policy asks for:
        rings and recurrent state always, full attention when the prompt is likely shared (followers
        wait for it, or its system prompt was not stored yet)."""
        if self.prompt_cache is None:
            return
        system = joiner.row.request.snapshot_at
        # A system prompt it found stored already needs no second publication: its tail alone is
        # stored when it ends (a burst on a cached prompt skips a put per row before token 0).
        shared = joiner.followers > 0 or (system is not None and joiner.row.output.cached_tokens < system)
        boundary = boundary_snapshot(len(joiner.prompt), joiner.trimmable, shared)
        if boundary is not None:
            self._store_and_hold(joiner, boundary)

    def _store_and_hold(self, joiner: Joiner, tokens: int) -> None:
        """Store its first ``tokens`` prompt tokens for others, and lease that chain itself: agents that
        start from it then find this row on their prefix, and their tails group with it by reference
        (engine/shared_tails.py) instead of each on a copy."""
        prefix, namespace = joiner.prompt[:tokens], joiner.row.request.namespace
        self.prompt_cache.put(namespace, prefix, joiner.caches)
        lease = self.prompt_cache.lease_stored(namespace, prefix, joiner.caches)
        if lease.held:  # else the tree did not keep it: the lease it has stays
            self._hold(joiner.row, lease)
            joiner.lent_by(lease)
