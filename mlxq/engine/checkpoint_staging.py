"""The batch lane's checkpoint links staged behind a decode step and published a step later.

A publish that waited for its copy would stall decoding: reading the
pending token and evaluating the copy wait for the step in flight, so the
engine thread, instead of building the next step while the device runs
the current one, waits for it, then builds the next while the device
idles; and moving the copy to the host on the engine thread holds the
engine (which is what bounds a batch's decode speed) for the copy. So a
due row's link is only *staged* in the step that drew its pending token
(engine/checkpoint_rows.py): its copies are queued on the generation
stream right behind that step's forward, evaluated asynchronously with the
row's key, and nothing is read. Only device work is queued here: a read of
a copy by MLX's CPU stream in the same evaluation would make the engine
thread wait on the host for the device to finish the step in flight
(store/checkpoint_pack.py). In the next step, once that step's tokens were
read (the step that drew the pending tokens is done), each staged link
reads its pending token and key (already computed: no wait) and is handed
to the writer, which moves the bytes to the host and reads them, holding
no GIL while it waits. A row that ended meanwhile publishes
nothing: it completed (its checkpoint goes anyway) or was cancelled (its
last checkpoint, taken at the cancel, is newer).

Rows stage while fewer than ``IN_FLIGHT_BYTES`` are copied but not yet on
disk (the writer's queue): a disk slower than the lane makes due rows wait
(their next link then covers every token since their last one), never
drops links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from mlxq.engine.checkpointing import RowCheckpoint, StagedLink

# Copies staged per decode step: four 256-token links of an 8B model, the eighth of a 32-row batch that
# ``publishes_per_step`` lets stage at once. Most of what a staging costs the engine thread is per
# staging, not per row (the views of every K/V array, the launches, their evaluation, one Pack to move
# and free: docs/benchmarks.md, "CPU and H200: generation checkpoints' cost on decode"), so fewer,
# larger stagings; the bytes cost the device a copy.
STAGE_BYTES_PER_STEP = 128 * 2**20
IN_FLIGHT_BYTES = 512 * 2**20  # queued for the writer: while more, due rows wait


@dataclass(eq=False)
class LinkInFlight:
    checkpoint: RowCheckpoint
    link: StagedLink
    next_tokens: mx.array  # the step's drawn tokens: the row's pending one at ``index``
    index: int
    key: mx.array | None  # the row's PRNG key before its next draw (seeded rows)

    def state(self, drawn: dict) -> tuple[int, tuple[int, ...] | None]:
        """The pending token and the key, once the step that drew them is done (``drawn``: id of a step's
        tokens -> their list, so each step's tokens are read once)."""
        tokens = drawn.get(id(self.next_tokens))
        if tokens is None:
            tokens = drawn[id(self.next_tokens)] = self.next_tokens.tolist()
        return tokens[self.index], None if self.key is None else tuple(self.key.tolist())


class LeftPaddings:
    """Each batch layer's left paddings as lists, read once per array: a layer's paddings change only when
    rows join or leave (a new array), and each read is a copy from the device (32 per row for an 8B
    model, every publish, if read each time)."""

    def __init__(self) -> None:
        self._read: dict[int, tuple[mx.array, list[int]]] = {}  # layer -> (the array read, its list)

    def of(self, caches: list) -> list:
        """Per layer: its left paddings (a list), or None for a layer without them."""
        out = []
        for layer, cache in enumerate(caches):
            array = getattr(cache, "left_padding", None)
            if array is None:
                out.append(None)
                continue
            read = self._read.get(layer)
            if read is None or read[0] is not array:
                read = self._read[layer] = (array, array.tolist())
            out.append(read[1])
        return out


class StagedLinks:
    """Links staged in the last step, not yet published."""

    def __init__(self) -> None:
        self._links: list[LinkInFlight] = []

    def __len__(self) -> int:
        return len(self._links)

    def stage(self, items: list[LinkInFlight]) -> None:
        """Queue the links' copies (and the rows' keys) behind the work already queued, without waiting:
        call in the stream of the step that drew their pending tokens. The writer, another thread,
        can only wait for arrays scheduled here (MLX's streams belong to the thread that made them)."""
        packs = {id(p): p for item in items for p in item.link.packs}  # links may share a Pack
        mx.async_eval(*(a for p in packs.values() for a in p.arrays), *(item.key for item in items
                                                                        if item.key is not None))
        self._links += items

    def publish(self) -> int:
        """Hand every staged link of a row still running to the writer, with its pending token and key
        (call once the step that drew them is done); the bytes published."""
        staged, self._links = self._links, []
        drawn: dict = {}
        nbytes = 0
        for item in staged:
            if item.link.output.finished is None:
                pending, rng_key = item.state(drawn)
                nbytes += item.checkpoint.commit(item.link, pending, rng_key)
        return nbytes
