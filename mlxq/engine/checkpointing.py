"""Generation checkpoints in the serial lane: publish a running request's state, resume an identical one.

At every ``interval`` tokens handed out, mlx-lm's pipelined loop stands at
the boundary a checkpoint needs: the caches hold the prompt and every token
handed out, and the next token (the *pending* one) is already sampled. What
the caches gained since the request's previous checkpoint link is copied
(the full-attention span since then, the ring and recurrent state whole:
arrays the writer owns, so the live caches keep updating in place) and
queued for store/checkpoints.py's writer thread as the next link of the
request's chain, with the pending token and, for seeded rows, MLX's global
key before the next draw.

An identical request (same key, engine/checkpoint_key.py) after a restart
replays the tokens handed out, then the pending one, through the request's
ordinary output (stop strings, max_tokens, usage), and continues from the
restored caches by feeding the pending token: the computation the
uninterrupted run did next. Seeded rows get the global key back by replay
(serial_resume.DrawLedger), checked against the recorded one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlxq.engine.checkpoint_key import checkpoint_key, is_due, not_checkpointed
from mlxq.engine.checkpoint_staging import LeftPaddings, StagedLinks
from mlxq.engine.serial_resume import InexactResume
from mlxq.engine.types import Request
from mlxq.kv.capabilities import is_trimmable
from mlxq.store.checkpoint_links import cut_layer
from mlxq.store.checkpoint_pack import pack_layers, settle, stage_packs
from mlxq.store.checkpoints import CheckpointRecord, CheckpointStore
from mlxq.store.mlxkv import encode_layer
from mlxq.store.ssd_config import CHECKPOINT_DIR

log = logging.getLogger("mlxq.checkpoints")


@dataclass
class Checkpointing:
    """The engine's checkpoint settings: where they go, how often, under which KV scheme."""

    store: CheckpointStore
    interval: int  # tokens handed out between checkpoints
    kv_scheme: str
    batch_staged: StagedLinks = field(default_factory=StagedLinks)  # the batch lane's links of the last step
    batch_paddings: LeftPaddings = field(default_factory=LeftPaddings)  # the batch's left paddings, read once

    def key_for(self, request: Request) -> str | None:
        """The request's key digest, or None when it is not checkpointed."""
        if not_checkpointed(request) is not None:
            return None
        return checkpoint_key(request, self.kv_scheme).digest

    def finished(self, request: Request) -> None:
        """A request completed (stop, length): its checkpoint goes at once (cancelled ones keep theirs)."""
        key = self.key_for(request)
        if key is not None:
            self.store.retire(key)


def open_checkpointing(config, store, kv_scheme: str) -> Checkpointing | None:
    """Checkpoints beside the SSD tier's node files (same model and KV identity), or None when off."""
    if config.checkpoint_interval <= 0:
        return None
    checkpoints = CheckpointStore(store.directory / CHECKPOINT_DIR, store.identity, store.model_name,
                                  layout=store.layout, max_bytes=store.max_bytes)
    try:
        checkpoints.scan()
    except OSError as exc:
        log.warning("checkpoints in %s cannot be read (%s); starting without them", checkpoints.directory, exc)
    return Checkpointing(checkpoints, config.checkpoint_interval, kv_scheme)


def owned_layers(caches: list, start: int = 0) -> list:
    """Each cache's encoded layer as a checkpoint link starting at token ``start`` holds it (full attention
    from ``start`` on, other layers whole), copied into one buffer the writer owns (evaluated and on the
    host; store/checkpoint_pack.py). Only the copied tokens are read: ``caches`` may be views into a batch."""
    return pack_layers(link_layers(caches, start))


def link_layers(caches: list, start: int) -> list:
    """The encoded layers a link starting at ``start`` holds (views: nothing copied yet)."""
    return [cut_layer(*encode_layer(cache), start) for cache in caches]


@dataclass(frozen=True, eq=False)
class StagedLink:
    """A link whose copy is described (or done) but not published yet: what ``RowCheckpoint.commit``
    needs besides the pending token and the key."""

    output: object  # the request's output
    generated: tuple[int, ...]  # tokens the caches hold after the prompt
    start: int  # the link covers tokens [start, prompt + generated)
    layers: list  # encoded layers, tensors packed (store/checkpoint_pack.py)
    packs: list  # their Packs
    trimmable: bool

    @property
    def nbytes(self) -> int:
        """Its tensors' bytes (a Pack may hold other links' tensors too: engine/checkpoint_spans.py)."""
        return sum(tensor.nbytes for _, _, named in self.layers for _, tensor in named)


@dataclass
class RowCheckpoint:
    """One request's checkpoints (either lane): its key, and when it last published."""

    checkpointing: Checkpointing
    key: str
    last: int = 0  # tokens handed out at the last checkpoint (or at the restore)
    tip: int = 0  # tokens (prompt and generated) the newest link covers: the next one chains on; 0: none

    def is_due(self, output) -> bool:
        return is_due(output.num_generated, self.checkpointing.interval, self.last)

    def stage(self, output, caches: list, max_pack_bytes: int | None = None, host_side: bool = False,
              drawn: tuple[int, ...] = ()) -> StagedLink:
        """Describe the link after ``output``'s tokens and ``drawn`` (generated, not handed out yet):
        ``caches`` hold the prompt and every one of them. Its copies are not evaluated here
        (store/checkpoint_pack.stage_packs), and the row does not count it as taken until ``taken``."""
        generated, start = self.plan(output, drawn)
        layers, packs = stage_packs(link_layers(caches, start), max_pack_bytes, host_side)
        return StagedLink(output, generated, start, layers, packs, is_trimmable(caches))

    def plan(self, output, drawn: tuple[int, ...] = ()) -> tuple[tuple[int, ...], int]:
        """A link taken now, after ``output``'s tokens and ``drawn``: the tokens it holds after the prompt,
        and the token its span starts at (the newest link's end when it can chain onto it, else 0).
        Nothing changes here: a copy that fails after this leaves the row as it was, still due."""
        generated = (*output.tokens, *drawn)
        end = len(output.request.prompt_ids) + len(generated)
        start = self.tip if 0 < self.tip <= end and self.checkpointing.store.is_link(self.key, self.tip) else 0
        return generated, start

    def taken(self, output) -> None:
        """The link planned after ``output``'s tokens is staged (its copies queued): the next is due an
        interval later."""
        self.last = output.num_generated

    def commit(self, link: StagedLink, pending: int, rng_key: tuple[int, ...] | None) -> int:
        """Queue ``link`` for the writer, ``pending`` drawn after its tokens. The bytes copied."""
        request = link.output.request
        record = CheckpointRecord(self.key, len(request.prompt_ids), link.generated, pending, rng_key, time.time())
        published = self.checkpointing.store.publish(record, request.prompt_ids + list(link.generated), link.layers,
                                                     link.trimmable, link.start)
        self.tip = record.end if published else 0  # a dropped link breaks the chain: the next one starts anew
        return link.nbytes

    def publish(self, output, pending: int, rng_key: tuple[int, ...] | None, caches: list,
                drawn: tuple[int, ...] = ()) -> int:
        """Queue the state after ``output``'s tokens and ``drawn`` (generated, not handed out yet) at once:
        ``caches`` hold the prompt and every one of them; ``pending`` was drawn after them. The bytes
        copied: 0 when the copy failed (the link is dropped, the request goes on, still due)."""
        try:
            link = self.stage(output, caches, drawn=drawn)
            settle(link.packs)
        except Exception:
            log.warning("request %s: checkpoint not copied; dropped", output.request.request_id, exc_info=True)
            self.checkpointing.store.note_dropped()
            return 0
        self.taken(output)
        return self.commit(link, pending, rng_key)

    def after_serial_token(self, run, caches: list) -> None:
        """The serial lane handed a token out and goes on: mlx-lm's loop already drew the next one."""
        if not self.is_due(run.output) or run.last_draw is None:
            return
        self.publish(run.output, int(run.last_draw.item()), _global_key(run), caches)

    def at_cancel(self, output, token: int, pending: int, rng_key: tuple[int, ...] | None, caches: list) -> int:
        """The request was cancelled before ``token`` was handed out, with the caches holding it and
        ``pending`` drawn after it: its last checkpoint, so that the same request later recomputes nothing
        (none when ``token`` is EOS: the request ended there). The bytes copied."""
        return 0 if output.is_eos(token) else self.publish(output, pending, rng_key, caches, drawn=(token,))

    def at_serial_cancel(self, run, token: int, caches: list) -> None:
        """The serial lane saw a cancel before handing ``token`` out; mlx-lm's loop already drew the next one."""
        if run.last_draw is not None:
            self.at_cancel(run.output, token, int(run.last_draw.item()), _global_key(run), caches)


def _global_key(run) -> tuple[int, ...] | None:
    """MLX's global key before the draw after the pending token (seeded runs; None for the others)."""
    return tuple(mx.random.state[0].tolist()) if run.draws is not None else None


@dataclass(frozen=True)
class Restored:
    """A checkpoint replayed into a request's output: the caches to continue on, the row's key."""

    caches: list  # every token but the pending one (the last handed out)
    rng_key: mx.array | None  # the PRNG key before the next draw (seeded rows)


def restore_output(output, checkpointing: Checkpointing, accept=None) -> tuple[RowCheckpoint | None, Restored | None]:
    """The request's checkpointing (None: not checkpointed) and, when its checkpoint is on disk, the
    restored state: its tokens and then its pending one are replayed through ``output`` first.
    ``accept(record)``: False leaves the checkpoint unused (before anything is replayed)."""
    request = output.request
    key = checkpointing.key_for(request)
    if key is None:
        return None, None
    checkpoint = RowCheckpoint(checkpointing, key)
    loaded = checkpointing.store.load(key)
    if loaded is None:
        return checkpoint, None
    record, caches = loaded
    if accept is not None and not accept(record):
        return checkpoint, None
    output.cached_tokens = record.prompt_tokens
    for token in (*record.emitted, record.pending):
        output.checkpoint_tokens += 1
        if output.add_token(token):
            break
    checkpoint.last, checkpoint.tip = len(record.emitted), record.end
    checkpointing.store.note_restored(output.checkpoint_tokens)
    log.info("request %s resumed from its checkpoint after %d tokens", request.request_id, output.checkpoint_tokens)
    rng = None if record.rng_key is None else mx.array(record.rng_key, dtype=mx.uint32)
    return checkpoint, Restored(caches, rng)


def restore_serial(run, checkpointing: Checkpointing) -> list | None:
    """Resume ``run`` from its checkpoint, if one is on disk: replay, then the caches to continue on."""
    run.checkpoint, restored = restore_output(run.output, checkpointing, lambda record: _global_key_at(run, record))
    return None if restored is None else restored.caches


def _global_key_at(run, record: CheckpointRecord) -> bool:
    """Put MLX's global key where it stood before the draw after the pending token (seeded runs), checked
    against the recorded key; False (and the key back at the seed) when the replay does not reach it."""
    draws = run.draws
    if draws is None:
        return True
    n = len(record.emitted) + 1  # draws made: every token handed out, and the pending one
    try:
        if record.rng_key is None:
            raise InexactResume("the checkpoint has no key")
        draws.replay(n, mx.array(record.rng_key, dtype=mx.uint32))
    except InexactResume as exc:
        log.warning("request %s: checkpoint not used: %s", run.request.request_id, exc)
        mx.random.seed(draws.seed)
        return False
    draws.first = n
    return True
