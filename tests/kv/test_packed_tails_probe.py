"""The once-per-model check that a packed tails' forward computes what the padded one does.

kv/packed_tails_probe.py's ``probe_disagreement`` runs two rows' tails both ways on the real model; the
sharing plan keeps its answer (``packed_tails_declined``), /stats shows it, and the scheduler packs
only where it is None. A model that would get other positions or cannot take one position per row
is kept padded, with the reason.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.engine.prefix_sharing import SharingPolicy, SharingStats
from mlxq.kv import attention_route, packed_tails, packed_tails_probe
from mlxq.kv.sharing_plan import plan_sharing


@pytest.fixture(autouse=True)
def routed():
    attention_route.install(check=False)
    yield
    attention_route.uninstall()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_models_whose_layers_all_share_pack_their_tails(load_tiny, arch):
    model, _ = load_tiny(arch)
    assert packed_tails_probe.probe_disagreement(model) is None
    plan = plan_sharing(model)
    assert plan.packed_tails_declined is None and packed_tails.packs(plan, [3, 9, 4])


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_models_with_layers_that_keep_per_row_caches_stay_padded(load_tiny, arch):
    """Sliding-window (gemma3_text) and recurrent (qwen3_next) layers keep per-row caches: the tails
    are never placed on a shared prefix, and the probe never runs."""
    model, _ = load_tiny(arch)
    plan = plan_sharing(model)
    assert not packed_tails.packs(plan, [3, 9, 4])
    assert plan.packed_tails_declined == "not every layer shares"


def test_a_model_that_would_see_other_positions_is_kept_padded(load_tiny, monkeypatch):
    """Every packed token at position 0 (what a module computing positions from the sequence axis
    would do): the logits differ, and the probe says by how much."""
    model, _ = load_tiny("llama")
    monkeypatch.setattr(packed_tails_probe, "packed_positions", lambda target, packing: mx.zeros_like(packing.rows))
    why = packed_tails_probe.probe_disagreement(model)
    assert why is not None and why.startswith("packed logits differ from padded ones by")


def test_a_model_that_cannot_take_one_position_per_row_is_kept_padded(load_tiny, monkeypatch):
    model, _ = load_tiny("llama")

    def refused(self, keys, values):
        raise RuntimeError("this module writes whole rows")

    monkeypatch.setattr(packed_tails.PackedTailsCache, "update_and_fetch", refused)
    assert packed_tails_probe.probe_disagreement(model) == (
        "a packed forward did not run (RuntimeError: this module writes whole rows)")


def test_stats_say_why_tails_run_padded(load_tiny, monkeypatch):
    model, _ = load_tiny("llama")
    plan = plan_sharing(model)
    stats = lambda policy: SharingStats().as_dict(policy, 0, ())  # noqa: E731
    assert stats(SharingPolicy("on", plan))["tails_packed_declined"] is None
    assert stats(None)["tails_packed_declined"] == "no shared-prefix plan"
    monkeypatch.setattr(packed_tails, "PACKED_TAILS", False)
    assert stats(SharingPolicy("on", plan))["tails_packed_declined"] == "MLXQ_PACKED_TAILS=0"


def test_tails_of_about_one_length_stay_padded(load_tiny, monkeypatch):
    """Packing pays only where the padded grid would compute padding: below ``MIN_PADDING_SHARE`` of
    it, the gathers cost more than they save."""
    model, _ = load_tiny("llama")
    plan = plan_sharing(model)
    assert packed_tails.padding_share([4, 8]) == 0.25
    assert packed_tails.packs(plan, [50, 58, 41]) and not packed_tails.packs(plan, [56, 56, 55])
    monkeypatch.setattr(packed_tails, "MIN_PADDING_SHARE", 0.0)
    assert packed_tails.packs(plan, [56, 56, 56])
