"""Per-row adapters in one forward against mlx-lm's own LoRA / DoRA layers and adapter loading (CPU, float32)."""

from __future__ import annotations

import gc
import re
import weakref
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

from mlxq.models.adapters import AdapterSpec, LowRank
from mlxq.models.loader import load_model
from mlxq.models.multi_lora import (
    BASE,
    AdapterRouting,
    MultiLoRALinear,
    adapter_rows,
    attach_adapters,
    install_adapters,
)
from mlxq.models.tiny_adapter import make_tiny_adapter

TOLERANCE = 1e-5  # the update's scale is folded into B and added by addmm: last bits, not tokens


def _mlx_lm_layer(base: nn.Module, dora: bool, seed: int, rank: int):
    mx.random.seed(seed)
    layer = (DoRALinear if dora else LoRALinear).from_base(base, r=rank, scale=3.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    if dora:
        layer.m = layer.m * mx.random.uniform(0.9, 1.1, layer.m.shape)
    return layer


def _pieces(layer, dora: bool) -> LowRank:
    gain = None
    if dora:
        adapted = layer._dequantized_weight() + (layer.scale * layer.lora_b.T) @ layer.lora_a.T
        gain = layer.m / mx.linalg.norm(adapted, axis=1)
    return LowRank(layer.lora_a, layer.lora_b, layer.scale, gain)


class Siblings(nn.Module):
    """Two projections of one input (q/k-like) and one of another (o-like): the shrink is shared or not."""

    def __init__(self, q: nn.Module, k: nn.Module, o: nn.Module):
        super().__init__()
        self.q_proj, self.k_proj, self.o_proj = q, k, o

    def __call__(self, x: mx.array, y: mx.array) -> list[mx.array]:
        return [self.q_proj(x), self.k_proj(x), self.o_proj(y)]


def _base(bias: bool, quantized: bool, seed: int) -> nn.Module:
    mx.random.seed(seed)
    base = nn.Linear(64, 48, bias=bias)
    return nn.QuantizedLinear.from_linear(base, group_size=32, bits=8) if quantized else base


@pytest.mark.parametrize("tokens", [1, 3])  # a decode step (gathered shrink) and a prefill chunk (masked)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_each_row_gets_its_own_adapters_update(bias, quantized, tokens):
    bases = {name: _base(bias, quantized, seed) for seed, name in enumerate(["q_proj", "k_proj", "o_proj"])}
    oracles = {"": dict(bases)}
    oracles["lora"] = {n: _mlx_lm_layer(b, False, 10 + i, 4) for i, (n, b) in enumerate(bases.items())}
    oracles["dora"] = {n: _mlx_lm_layer(b, True, 20 + i, 8) for i, (n, b) in enumerate(bases.items())}
    model = Siblings(*bases.values())
    pieces = [{n: _pieces(layer, kind == "dora") for n, layer in oracles[kind].items()} for kind in ("lora", "dora")]
    del pieces[1]["k_proj"]  # an adapter may leave a layer alone
    oracles["dora"]["k_proj"] = bases["k_proj"]
    install_adapters(model, ["lora", "dora"], pieces)
    mx.random.seed(5)
    x, y = mx.random.normal((6, tokens, 64)), mx.random.normal((6, tokens, 64))
    names = ["lora", "", "dora", "dora", "", "lora"]
    with adapter_rows(model, names):
        mixed = model(x, y)
    for i, name in enumerate(names):
        want = [oracles[name][n](v[i : i + 1]) for n, v in (("q_proj", x), ("k_proj", x), ("o_proj", y))]
        with adapter_rows(model, [name]):
            alone = model(x[i : i + 1], y[i : i + 1])
        for got_alone, got_mixed, w in zip(alone, mixed, want, strict=True):
            assert mx.abs(got_alone - w).max().item() < TOLERANCE, name
            assert mx.abs(got_mixed[i : i + 1] - w).max().item() < TOLERANCE, (i, name)
    assert mx.abs(oracles["lora"]["q_proj"](x) - bases["q_proj"](x)).max().item() > 0.1  # adapters matter
    with adapter_rows(model, [""] * 6):
        assert all(mx.array_equal(a, b) for a, b in zip(model(x, y), [bases["q_proj"](x), bases["k_proj"](x),
                                                                     bases["o_proj"](y)], strict=True))


def test_siblings_share_a_shrink_only_when_they_read_one_input():
    """q/k share one shrink; o_proj, with q's parent and input width, reads another input: its own."""
    bases = [_base(False, False, seed) for seed in range(3)]
    pieces = [{n: _pieces(_mlx_lm_layer(b, False, i, 4), False) for i, (n, b) in
               enumerate(zip(["q_proj", "k_proj", "o_proj"], bases, strict=True))}]
    model = Siblings(*bases)
    install_adapters(model, ["a"], pieces)
    assert model.q_proj._shrink is model.k_proj._shrink is not model.o_proj._shrink
    assert (model.k_proj._shrink.members, model.o_proj._shrink.members) == (2, 1)


def test_routing_decides_once_per_composition():
    routing = AdapterRouting(["a", "b"], [2, 3], mx.float32)
    assert routing.route_for(["", ""]) is BASE
    assert routing.route_for(["b", "b"]).slot == 1
    mixed = routing.route_for(["a", "", "b"])
    assert routing.route_for(["b", "a"]) is not mixed
    assert mixed is routing.route_for(["a", "", "b"])  # a decode step's composition is reused between prefills
    assert mixed.mask[:, 0, :].tolist() == [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert mixed.indices.tolist() == [0, 2, 1]
    with routing.rows(["a"]):
        with routing.rows(["a", "b"]):
            assert routing.route.mask is not None
        assert routing.route.slot == 0
    assert routing.route is BASE


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_next"])
def test_a_model_with_adapters_equals_mlx_lm_loading_each_one(arch, tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs[arch]
    lora = make_tiny_adapter(model_dir, tmp_path / "lora", seed=1, rank=4)
    dora = make_tiny_adapter(model_dir, tmp_path / "dora", seed=2, rank=8, kind="dora", num_layers=2)
    loaded = attach_adapters(load_model(str(model_dir)), [AdapterSpec("lora", lora), AdapterSpec("dora", dora)])
    tokens = mx.array([list(range(5, 25))])
    want = {"": mlx_lm.load(str(model_dir))[0](tokens)[:, -1]}
    for name, path in (("lora", lora), ("dora", dora)):
        want[name] = mlx_lm.load(str(model_dir), adapter_path=str(path))[0](tokens)[:, -1]
        assert mx.abs(want[name] - want[""]).max().item() > 0.1, "the adapter must change the logits"
    names = ["dora", "", "lora", "lora"]
    with adapter_rows(loaded.model, names):
        got = loaded.model(mx.concatenate([tokens] * 4))[:, -1]
    shrinks = [m._shrink for _, m in loaded.model.named_modules() if isinstance(m, MultiLoRALinear)]
    assert shrinks and all(not s._made for s in shrinks)  # no layer's input outlives the forward
    for i, name in enumerate(names):
        assert mx.abs(got[i] - want[name][0]).max().item() < TOLERANCE, (arch, name)
        assert got[i].argmax().item() == want[name][0].argmax().item()


def _graph_nodes(outputs: mx.array, path) -> list[str]:
    """The primitives of the graph that computes ``outputs`` (MLX's own DOT export)."""
    mx.export_to_dot(str(path), outputs)
    return re.findall(r'label ="([A-Za-z]+)', path.read_text())


def test_a_decode_step_with_adapters_adds_no_matmul(tiny_model_dirs, tmp_path):
    """Per sibling group a gather and a concatenation; the expand rides in the base matmul."""
    from mlx_lm.models.cache import make_prompt_cache

    model_dir = tiny_model_dirs["llama"]
    specs = [AdapterSpec(f"a{i}", make_tiny_adapter(model_dir, tmp_path / f"a{i}", seed=i, rank=4)) for i in range(2)]
    model = attach_adapters(load_model(str(model_dir)), specs).model
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7]] * 3), cache=caches))
    counts = {}
    for mix, names in {"base": ["", "", ""], "one": ["a0"] * 3, "mixed": ["a0", "", "a1"]}.items():
        with adapter_rows(model, names):
            logits = model(mx.array([[8]] * 3), cache=caches)
        counts[mix] = Counter(_graph_nodes(logits, tmp_path / f"{mix}.dot"))
        mx.eval(logits)  # the caches too: the next step's graph starts from evaluated arrays
        for cache in caches:
            cache.trim(1)
    groups = 4 * len(model.layers)  # q/k/v, o, gate/up, down
    for mix in ("one", "mixed"):
        assert counts[mix]["Matmul"] + counts[mix]["AddMM"] == counts["base"]["Matmul"] + counts["base"]["AddMM"]
        assert counts[mix]["GatherMM"] == groups
        assert counts[mix]["Concatenate"] - counts["base"]["Concatenate"] == groups
        assert sum(counts[mix].values()) - sum(counts["base"].values()) <= groups  # the transposes go


def test_the_extended_weight_is_the_base_weight_stored_once():
    """The base layer keeps a view of the extended weight: the old weight is gone, the adapters' arrays
    are all that installing adds."""
    from mlxq.engine.memory import weight_bytes

    model = Siblings(*[_base(False, False, seed) for seed in range(3)])
    names = ("q_proj", "k_proj", "o_proj")
    values = {n: np.array(getattr(model, n).weight) for n in names}
    old = [weakref.ref(getattr(model, n).weight) for n in names]
    base_bytes = weight_bytes(model)
    pieces = [{n: _pieces(_mlx_lm_layer(getattr(model, n), False, i, 4), False) for i, n in enumerate(names)}]
    install_adapters(model, ["a"], pieces)
    gc.collect()
    assert all(ref() is None for ref in old)
    b_rows = (8 + 8 + 4) * 48  # q/k: rank 4 padded to their shared shrink's 8 columns; o: 4
    a_columns = (8 + 4) * 64 * 3  # every adapter's, then the stack: the adapter's and a zero slot for base rows
    assert weight_bytes(model) - base_bytes == (b_rows + a_columns) * 4  # float32
    for name, weight in values.items():
        layer = getattr(model, name)
        assert np.array_equal(np.array(layer.base.weight), weight)
        assert np.array_equal(np.array(layer._extended[:64]), weight.T)
