"""mlxq's row surgery equals mlx-lm's batch caches, recorded as model-free goldens (goldens/batched.json)."""

from __future__ import annotations

import pytest

from mlxq.golden.cache_ops import KINDS, CacheOps, run_scenario
from mlxq.golden.store import load_goldens
from mlxq.kv.batch_ops import extend_batch, extract_row, keep_rows, merge_solo_rows

MLXQ_OPS = CacheOps(
    merge=lambda solos: merge_solo_rows([[c] for c in solos])[0],
    extend=lambda batch, other: extend_batch([batch], [other]),
    keep=lambda batch, rows: keep_rows([batch], rows),
    extract=lambda batch, i: extract_row([batch], i)[0],
)


@pytest.mark.parametrize("kind", KINDS)
def test_row_surgery_matches_mlx_lm_goldens(kind):
    expected = load_goldens("batched")[0]["cache_ops"][kind]
    got = run_scenario(kind, MLXQ_OPS)
    assert got == expected


def test_the_goldens_exercise_ring_wraps_and_padding():
    ops = load_goldens("batched")[0]["cache_ops"]
    rotating = ops["rotating"]
    assert rotating["decoded"]["rotated"] is True  # the rings wrapped inside the batch
    assert rotating["extracted"][1]["offset"] == 20 + 10  # 20 prompt tokens + 10 decoded, window 8
    assert ops["full"]["joined"]["left_padding"] == [15, 8, 0]  # rows right-aligned at the longest
