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

from collections.abc import Sequence

from mlxq.models.adapters import AdapterError, AdapterInfo, LowRank, check_adapter_dir, read_adapter
from mlxq.models.multi_lora import install_adapters


def read_whole_adapters(model, specs: Sequence) -> tuple[list[AdapterInfo], list[dict[str, LowRank]]]:
    """Every ``--adapter`` read against the whole model, before it is split."""
    infos = [check_adapter_dir(spec) for spec in specs]
    return infos, [read_adapter(model, info) for info in infos]


def install_pipeline_adapters(model, infos: Sequence[AdapterInfo], pieces: Sequence[dict[str, LowRank]],
                              model_name: str, rank: int) -> None:
    """Install the parts of ``pieces`` on the layers this rank holds."""
    names = [info.name for info in infos]
    taken = [name for name in names if name == model_name or names.count(name) > 1]
    if taken:
        raise AdapterError(f"--adapter {taken[0]}: the name is already taken (by the base model or another "
                           "adapter); every model id must be unique")
    held = {path for path, _ in model.named_modules()}
    mine = [{path: piece for path, piece in adapter.items() if path in held} for adapter in pieces]
    for info, part in zip(infos, mine, strict=True):
        if not part:  # the routing needs each adapter on at least one layer of every rank
            raise AdapterError(f"--adapter {info.name}: adapts none of the layers pipeline rank {rank} holds; "
                               "with --pipeline-parallel an adapter must touch a layer of every rank")
    install_adapters(model, names, mine)
