"""Adapters on a pipeline-parallel model: each rank adapts the layers it holds.

mlx-lm's ``pipeline()`` keeps whole layers on each rank (a contiguous run;
rank 0 the last ones), and every rank keeps the embeddings, the final norm
and the head. An adapter therefore needs no split (unlike tensor
parallelism, models/sharded_lora.py): it is read against the whole, still
lazy model before ``pipeline()`` drops the other ranks' layers (mlx-lm
checks every tensor's name and shape there), and each rank installs the
parts of the layers it kept, as one process installs all of them. DoRA
works too: its magnitudes are per whole layer, and each layer is whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mlxq.models.adapters import AdapterError, AdapterInfo, LowRank, check_adapter_dir, check_model_ids, read_adapter
from mlxq.models.multi_lora import install_adapters

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_whole_adapters(model, specs: Sequence, size: int) -> tuple[list[AdapterInfo], list[dict[str, LowRank]]]:
    """Every ``--adapter`` read against the whole model, before it is split over ``size`` ranks.

    Refused here, on every rank alike, is an adapter that touches none of some rank's layers (its
    routing needs a layer on every rank): a refusal on one rank only would leave the others waiting
    for it in the next collective."""
    infos = [check_adapter_dir(spec) for spec in specs]
    pieces = [read_adapter(model, info) for info in infos]
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return infos, pieces  # no pipeline() either: the split refuses the model
    spans = pipeline_spans(len(layers), size)
    for info, adapter in zip(infos, pieces, strict=True):
        touched = {_layer_number(path) for path in adapter}
        if None in touched:
            continue  # it adapts a module every rank keeps (the head)
        for rank, held in enumerate(spans):
            if not touched & set(held):
                raise AdapterError(f"--adapter {info.name}: adapts none of the layers pipeline rank {rank} holds "
                                   f"({held.start}-{held.stop - 1}); with --pipeline-parallel an adapter must "
                                   "touch a layer of every rank")
    return infos, pieces


def pipeline_spans(num_layers: int, size: int) -> list[range]:
    """The layers each rank keeps under mlx-lm's ``pipeline()`` (its default split, by rank): an even
    split, the low ranks one more layer each when it does not divide, rank 0 the last layers."""
    base, extra = divmod(num_layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    starts = [sum(split[r + 1:]) for r in range(size)]
    return [range(start, start + count) for start, count in zip(starts, split, strict=True)]


def _layer_number(path: str) -> int | None:
    match = _LAYER.search(path)
    return int(match.group(1)) if match else None


def install_pipeline_adapters(model, infos: Sequence[AdapterInfo], pieces: Sequence[dict[str, LowRank]],
                              model_name: str) -> None:
    """Install the parts of ``pieces`` on the layers this rank holds (read_whole_adapters checked that
    every adapter has some)."""
    names = [info.name for info in infos]
    check_model_ids(names, model_name)
    held = {path for path, _ in model.named_modules()}
    install_adapters(model, names, [{path: piece for path, piece in adapter.items() if path in held}
                                    for adapter in pieces])
