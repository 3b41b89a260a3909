"""The shared-prefix kernels' start-up self-check runs on the variants the model launches.

kv/sharing_plan.py's probe reads each sharing layer's attention call (dtype,
query and KV heads, head width, sinks) and hands that layout to
``shared_prefix_decode.enable``: the check compiles and compares what
serving will launch (a model without sinks never runs the sinks variants),
and nothing else. A check that fails keeps the kernels off and ``auto``
says why in /stats.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.engine.prefix_sharing import SharingPolicy
from mlxq.kv import attention_route
from mlxq.kv import shared_prefix_decode as decode
from mlxq.kv.sharing_plan import plan_sharing


@pytest.fixture(autouse=True)
def routed():
    yield
    attention_route.uninstall()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_probe_hands_the_models_attention_layout_to_the_check(load_tiny, monkeypatch, arch):
    model, _ = load_tiny(arch)
    seen = []
    monkeypatch.setattr(decode, "enable", lambda layout=None: seen.append(layout) or False)
    assert plan_sharing(model).can_share
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    assert seen == [decode.Layout(dtype, heads, kv_heads, dim, False)]


def recorded_checks(monkeypatch, layout):
    calls = []

    def path_error(path, args, want):
        q, pk, *_, sinks, _quant, shares = args
        calls.append((path, q.dtype, q.shape[1], pk.shape[1], q.shape[-1], sinks is not None, shares is not None))
        return 0.0

    monkeypatch.setattr(decode, "_path_error", path_error)
    errors = decode.self_check(layout=layout)
    return errors, calls


@pytest.mark.parametrize("sinks", [False, True])
def test_the_check_runs_the_layouts_variants_only(monkeypatch, sinks):
    layout = decode.Layout(mx.bfloat16, 32, 8, 128, sinks)
    errors, calls = recorded_checks(monkeypatch, layout)
    assert set(errors) == set(decode.checked_paths(mx.bfloat16))
    assert {call[:5] for call in calls} == {(path, mx.bfloat16, 32, 8, 128) for path in errors}
    assert {call[5] for call in calls} == {sinks}  # never the variant the model does not launch
    assert {call[6] for call in calls} == {False, True}  # every row in the group, and rows outside it


def test_without_a_layout_the_check_runs_both_sinks_variants(monkeypatch):
    _, calls = recorded_checks(monkeypatch, None)
    assert {call[5] for call in calls} == {False, True}
    assert {call[2:5] for call in calls} == {(8, 2, 128)}


def test_a_float16_model_is_checked_in_float16_without_the_bf16_only_paths(monkeypatch):
    errors, calls = recorded_checks(monkeypatch, decode.Layout(mx.float16, 16, 4, 64, False))
    assert set(errors) == {"full", "split", "gqa"} and {call[1] for call in calls} == {mx.float16}
    assert not decode._mma_partials_agree(decode.Layout(mx.float16, 16, 4, 64, False))


@pytest.mark.parametrize("layout, kept", [
    (decode.Layout(mx.bfloat16, 32, 8, 128, False), True),
    (decode.Layout(mx.bfloat16, 32, 8, 96, False), False),  # a head width the kernels do not have
    (decode.Layout(mx.bfloat16, 30, 8, 128, False), False),  # heads not a multiple of KV heads
    (decode.Layout(mx.int8, 32, 8, 128, False), False),
])
def test_a_layout_the_kernels_do_not_take_falls_back_to_the_default_check(layout, kept):
    assert decode.checkable(layout) == (layout if kept else None)


def test_a_failed_check_keeps_auto_from_sharing_and_says_so(load_tiny, monkeypatch):
    model, _ = load_tiny("llama")
    plan = plan_sharing(model)
    assert SharingPolicy("auto", plan).declined() is None  # on the CPU the check never ran
    monkeypatch.setattr(decode, "_report", {"layout": "bfloat16, 32 query / 8 KV heads of 128, no sinks",
                                            "max_diff": {"full": 0.5}, "passed": []})
    monkeypatch.setattr(decode, "_kernels", frozenset())
    policy = SharingPolicy("auto", plan)
    assert "failed their start-up self-check" in policy.declined()
    assert not policy.wants(64, 2048)
    assert SharingPolicy("on", plan).declined() is None  # ``on`` shares through plain operations

