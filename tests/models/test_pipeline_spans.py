"""models/pipeline_lora.py predicts each rank's layers as mlx-lm's pipeline() splits them: the adapter
check runs before the split, on every rank alike, so a wrong prediction would refuse or admit wrongly."""

from __future__ import annotations

import pytest
from mlx_lm.models.pipeline import PipelineMixin

from mlxq.models.pipeline_lora import pipeline_spans


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(("layers", "size"), [(4, 2), (3, 2), (7, 4), (80, 3)])
def test_spans_are_the_layers_mlx_lm_keeps_on_each_rank(layers, size):
    kept = []
    for rank in range(size):
        model = PipelineMixin()
        model.layers = list(range(layers))
        model.pipeline(_Group(rank, size))
        kept.append(range(model.start_idx, model.end_idx))
    assert pipeline_spans(layers, size) == kept
