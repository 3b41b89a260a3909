"""CPU attention routing (kv/cpu_attention.py): prefill attention with the softmax cut into blocks of
queries equals MLX's own attention bit for bit, for every mask kind it takes, and a model routed
through it computes the same logits as mlx-lm's path."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from mlxq.kv import attention_route, cpu_attention

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="routes MLX's CPU backend only")


@pytest.fixture
def routed_only_here(monkeypatch):
    """The route installed for this test, every model module given back its function after."""
    import sys

    before = {name: module.scaled_dot_product_attention for name, module in list(sys.modules.items())
              if name.startswith("mlx_lm.models.") and hasattr(module, "scaled_dot_product_attention")}
    monkeypatch.setattr(cpu_attention, "_installed", False)
    yield
    for name, function in before.items():
        sys.modules[name].scaled_dot_product_attention = function


def _qkv(batch, heads, kv_heads, length, span, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((batch, heads, length, 64)), mx.random.normal((batch, kv_heads, span, 64)),
            mx.random.normal((batch, kv_heads, span, 64)))


def _masks(batch, length, span):
    causal = mx.arange(span - length, span)[:, None] >= mx.arange(span)[None, :]
    starts = (mx.arange(batch) * 3)[:, None, None, None]  # left padding per row, as a batch's mask has
    padded = causal[None, None] & (mx.arange(span)[None, None, None, :] >= starts)
    return {"none": None, "causal": "causal", "bool": padded, "bool-2d": causal}


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "bool-2d"])
@pytest.mark.parametrize("batch,heads,kv_heads,length,span", [
    (1, 8, 4, 522, 522),  # a prompt's prefill: nine blocks, the causal ones cut short
    (1, 8, 8, 300, 812),  # a chunk after a cached prefix
    (7, 8, 4, 59, 529),  # joiners' tails on their prefixes
    (3, 4, 1, 130, 130),
    (2, 8, 2, 17, 40),  # one block
])
def test_equals_mlx_attention_bit_for_bit(kind, batch, heads, kv_heads, length, span):
    q, k, v = _qkv(batch, heads, kv_heads, length, span)
    mask = _masks(batch, length, span)[kind]
    assert cpu_attention.applies(q, k, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = cpu_attention.attention(q, k, v, 0.125, mask)
    assert got.shape == want.shape
    assert mx.array_equal(got, want, equal_nan=True).item()  # rows masked whole are NaN in both


def test_on_two_streams_too(monkeypatch):
    monkeypatch.setattr(cpu_attention, "STREAMS", 2)
    q, k, v = _qkv(1, 8, 4, 200, 260)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    assert mx.array_equal(cpu_attention.attention(q, k, v, 0.2, "causal"), want).item()


def test_what_it_does_not_take_goes_to_mlx_lm(monkeypatch):
    q, k, v = _qkv(1, 8, 4, 64, 64)
    assert not cpu_attention.applies(q[:, :, :1], k, None)  # a decode step
    assert not cpu_attention.applies(q.astype(mx.bfloat16), k.astype(mx.bfloat16), "causal")
    assert not cpu_attention.applies(q, k, mx.zeros((64, 64)))  # additive
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: pytest.fail("routed"))
    cpu_attention.route(q[:, :, :1], k, v, None, 0.1, None)
    cpu_attention.route(q, k, v, None, 0.1, "causal", sinks=mx.zeros((8,)))


def test_a_model_through_the_route_computes_mlx_lm_logits(load_tiny, routed_only_here):
    import mlx_lm.models.llama as llama

    model, _ = load_tiny("llama")
    chunks = [[(7 * i + 3) % 400 + 10 for i in range(n)] for n in (150, 40, 1, 70)]

    def logits():
        cache = make_prompt_cache(model)
        out = [model(mx.array([chunk]), cache=cache) for chunk in chunks]
        mx.eval(out)
        return out

    want = logits()
    assert cpu_attention.install()
    assert llama.scaled_dot_product_attention is cpu_attention.route
    got = logits()
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))


def test_the_shared_prefix_seam_wraps_it_and_gives_it_back(load_tiny, routed_only_here):
    import mlx_lm.models.llama as llama

    load_tiny("llama")
    assert cpu_attention.install()
    attention_route.install(check=False)
    assert llama.scaled_dot_product_attention is attention_route.route
    attention_route.uninstall()
    assert llama.scaled_dot_product_attention is cpu_attention.route
    assert base.scaled_dot_product_attention is not cpu_attention.route
