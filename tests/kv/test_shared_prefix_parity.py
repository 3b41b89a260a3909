"""Rows decoding over one shared prefix (SharedPrefixBatchCache through the attention seam) give
their solo tokens, for every tiny architecture; architectures or layers that decline sharing too.

Oracle: mlx-lm's generate_step on each row alone (greedy). The logits are also compared with
today's unshared batched path (per-row copies in a BatchKVCache) on the same rows: measured max
difference on CPU float32 3.3e-6 with MKL, 3.9e-6 under the reference BLAS (the prefix and the tail
are summed apart and merged: another order, never bit-exact);
the bound is 1e-5.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxq.kv import attention_route
from mlxq.kv.batch_ops import extract_row, keep_rows, merge_solo_rows
from mlxq.kv.capabilities import cache_kind
from mlxq.kv.shared_prefix_cache import SharedPrefixBatchCache
from mlxq.kv.sharing_plan import plan_sharing, share_prefix
from mlxq.models.presets import ARCHS

NEW_TOKENS = 8
LOGIT_BOUND = 1e-5


@pytest.fixture(autouse=True)
def routed():
    """The seam is installed by plan_sharing; give the modules back for the other tests."""
    yield
    attention_route.uninstall()


def prompts(tokenizer) -> tuple[int, list[list[int]]]:
    shared = tokenizer.encode("You are a careful agent. Tools: read, write, search. " * 3)
    own = ["Fix the bug.", "What is in the repo today?", "Hi", "List every file and then say why."]
    return len(shared), [shared + tokenizer.encode(" " + q) for q in own]


def prefilled(model, prompt: list[int]) -> list:
    """A solo cache holding all but the prompt's last token (the batch lane's join state)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    return cache


def greedy(model, caches: list, last: list[int], steps: int) -> tuple[list[list[int]], list[mx.array]]:
    tokens, logits = [[] for _ in last], []
    step = mx.array(last)[:, None]
    for _ in range(steps):
        out = model(step, cache=caches)[:, -1, :].astype(mx.float32)
        step = out.argmax(axis=-1)[:, None]
        mx.eval(step, out)
        logits.append(out)
        for row, token in enumerate(step[:, 0].tolist()):
            tokens[row].append(token)
    return tokens, logits


def solo(model, prompt: list[int], steps: int) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=steps):
        out.append(int(token))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_rows_equal_their_solo_runs(load_tiny, arch):
    model, tokenizer = load_tiny(arch)
    prefix_length, rows = prompts(tokenizer)
    plan = plan_sharing(model)
    assert plan.can_share
    caches = make_prompt_cache(model)
    assert plan.shared == tuple(type(c) is KVCache for c in caches)  # rings and recurrent layers keep rows

    shared = share_prefix(plan, [prefilled(model, p) for p in rows], prefix_length)
    assert [isinstance(c, SharedPrefixBatchCache) for c in shared] == list(plan.shared)
    last = [p[-1] for p in rows]
    tokens, logits = greedy(model, shared, last, NEW_TOKENS)
    unshared_tokens, unshared_logits = greedy(
        model, merge_solo_rows([prefilled(model, p) for p in rows]), last, NEW_TOKENS)

    for row, prompt in enumerate(rows):
        assert tokens[row] == solo(model, prompt, NEW_TOKENS), row
    assert tokens == unshared_tokens
    worst = max(mx.abs(a - b).max().item() for a, b in zip(logits, unshared_logits, strict=True))
    assert worst < LOGIT_BOUND


def test_rows_leave_and_join_a_group_without_copying_the_prefix(load_tiny):
    """filter keeps the prefix reference; extract gives a plain KVCache that decodes on alone;
    extend joins a group only on the same prefix."""
    model, tokenizer = load_tiny("llama")
    prefix_length, rows = prompts(tokenizer)
    plan = plan_sharing(model)
    group = share_prefix(plan, [prefilled(model, p) for p in rows], prefix_length)
    prefix_keys = group[0].prefix_keys
    last = [p[-1] for p in rows]
    tokens, _ = greedy(model, group, last, 2)

    leaver = extract_row(group, 1)
    assert type(leaver[0]) is KVCache and leaver[0].offset == len(rows[1]) - 1 + 2
    keep_rows(group, [0, 2, 3])
    assert group[0].prefix_keys is prefix_keys and cache_kind(group[0]).value == "full"
    more, _ = greedy(model, group, [t[-1] for i, t in enumerate(tokens) if i != 1], 3)
    alone, _ = greedy(model, leaver, [tokens[1][-1]], 3)
    expected = {i: solo(model, p, 5) for i, p in enumerate(rows)}
    assert [tokens[i] + more[j] for j, i in enumerate([0, 2, 3])] == [expected[i] for i in (0, 2, 3)]
    assert tokens[1] + alone[0] == expected[1]

    other = share_prefix(plan, [prefilled(model, rows[1])], prefix_length)
    group[0].extend(other[0])  # another prefix's arrays: a second group, not a copy into the first
    assert group[0].row_groups == [0, 0, 0, 1] and group[0].prefixes[1][0] is other[0].prefix_keys


def test_a_row_outside_the_group_decodes_beside_it(load_tiny):
    """A stray row (another prompt) rides in the same cache with shares=False: its tail is its whole
    history and it never sees the prefix; every row still equals its solo run."""
    model, tokenizer = load_tiny("qwen3")
    prefix_length, rows = prompts(tokenizer)
    rows[2] = tokenizer.encode("An unrelated request with a prompt of its own.")
    shares = [True, True, False, True]
    group = share_prefix(plan_sharing(model), [prefilled(model, p) for p in rows], prefix_length, shares=shares)
    assert group[0].offset.tolist() == [len(p) - 1 for p in rows]
    last = [p[-1] for p in rows]
    tokens, logits = greedy(model, group, last, 4)
    _, unshared_logits = greedy(model, merge_solo_rows([prefilled(model, p) for p in rows]), last, 4)
    assert tokens == [solo(model, p, 4) for p in rows]
    assert max(mx.abs(a - b).max().item() for a, b in zip(logits, unshared_logits, strict=True)) < LOGIT_BOUND
    stray = group[0].extract(2)
    assert stray.offset == len(rows[2]) - 1 + 4
    keep_rows(group, [2, 3])
    assert group[0].row_shares == [False, True]


def test_the_prefix_can_come_from_a_node_chains_spans(load_tiny):
    """The scheduler hands the prefix as the prompt cache's spans (here cut at uneven boundaries
    with the store's own cut_span): the group decodes exactly as with row 0's own view."""
    from mlxq.kv.sharing_plan import prefix_from_spans
    from mlxq.store.kv_spans import cut_span

    model, tokenizer = load_tiny("llama")
    prefix_length, rows = prompts(tokenizer)
    plan = plan_sharing(model)
    donor = prefilled(model, rows[0])
    cuts = [0, 7, 40, prefix_length]
    spans = [[cut_span(c, a, b) for a, b in zip(cuts, cuts[1:], strict=False)] for c in donor]
    prefix = prefix_from_spans(spans)
    from_spans = share_prefix(plan, [prefilled(model, p) for p in rows], prefix_length, prefix)
    from_row = share_prefix(plan, [prefilled(model, p) for p in rows], prefix_length)
    last = [p[-1] for p in rows]
    (tokens, logits), (want, want_logits) = greedy(model, from_spans, last, 3), greedy(model, from_row, last, 3)
    assert tokens == want
    assert all(mx.array_equal(a, b).item() for a, b in zip(logits, want_logits, strict=True))
    assert prefix_from_spans([None, []]) == [None, None]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_quantized_rows_share_a_quantized_prefix(load_tiny, arch):
    """--kv-quant: the group shares the prefix's triples (mx.quantized_matmul for both products).
    The oracle is the unshared quantized batch (BatchQuantizedKVCache through mlx-lm's quantized
    attention) over the same bytes: each row extracted from the group (a QuantizedKVCache of
    prefix + tail). Rows' own prefills would differ from row 0's in the last float bit, and
    quantization turns that into whole quanta, so copies quantized apart are not the same input.
    Tokens equal. The first step's logits are within float32 rounding (measured 2.1e-6); later
    steps attend to the new tokens' K/V, quantized from attention outputs that differ in the
    last bits, and one flipped quantum there moves the logits more (measured up to 5.3e-5 at
    8 bits, 2.6e-6 at 4 bits; logits up to ~3.2)."""
    model, tokenizer = load_tiny(arch)
    prefix_length, rows = prompts(tokenizer)
    plan = plan_sharing(model)
    assert plan.quantized == (mx.default_device() == mx.cpu)
    if not plan.quantized:
        pytest.skip("quantized layers share on the CPU only")

    def quantized(prompt):
        return [c.to_quantized(group_size=64, bits=8) if type(c) is KVCache else c for c in prefilled(model, prompt)]

    solo_rows = [quantized(p) for p in rows]
    group = share_prefix(plan, solo_rows, prefix_length)
    assert [isinstance(c, SharedPrefixBatchCache) and c.quant is not None for c in group] == list(plan.shared)
    same_bytes = [[g.extract(i) if isinstance(g, SharedPrefixBatchCache) else solo[layer]
                   for layer, g in enumerate(group)] for i, solo in enumerate(solo_rows)]
    shared_layers = [layer for layer, share in enumerate(plan.shared) if share]
    assert all(type(same_bytes[0][layer]) is QuantizedKVCache for layer in shared_layers)
    unshared = merge_solo_rows(same_bytes)
    last = [p[-1] for p in rows]
    tokens, logits = greedy(model, group, last, 4)
    want, want_logits = greedy(model, unshared, last, 4)
    assert tokens == want
    assert mx.abs(logits[0] - want_logits[0]).max().item() < LOGIT_BOUND


def test_a_model_computing_attention_by_hand_is_declined(load_tiny, monkeypatch):
    """A layer whose attention does not come through the seam would see its tail alone: the plan says no."""
    import mlx_lm.models.llama as llama

    model, _ = load_tiny("llama")
    by_hand = attention_route._mlx_lm_attention
    monkeypatch.setattr(llama, "scaled_dot_product_attention",
                        lambda q, k, v, cache, scale, mask, sinks=None: by_hand(q, k, v, None, scale, mask))
    plan = plan_sharing(model)
    assert not plan.can_share and "outside" in plan.declined
    assert plan.shared == (False,) * len(model.layers)


def test_mlx_lm_quantized_attention_scales_queries_in_place_but_not_through_the_route():
    """mlx-lm's quantized SDPA does ``queries *= scale``: a router that called it and then fell back
    would attend with scaled queries. route() hands it a fresh array, so the caller's stays intact."""
    from mlx_lm.models import base

    mx.random.seed(0)
    queries = mx.random.normal((1, 4, 1, 64))
    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 64)))
    cache = kv.to_quantized(group_size=64, bits=8)
    keys, values = cache.keys, cache.values
    original = mx.array(queries.tolist())

    exposed = queries
    base.scaled_dot_product_attention(exposed, keys, values, cache, 0.5, None)
    assert mx.allclose(queries, original * 0.5).item()  # the trap: the caller's array changed

    queries = mx.array(original.tolist())
    routed = attention_route.route(queries, keys, values, cache, 0.5, None)
    assert mx.array_equal(queries, original).item()
    want = base.quantized_scaled_dot_product_attention(mx.array(original.tolist()), keys, values, 0.5, None)
    assert mx.array_equal(routed, want).item()
    assert isinstance(cache, QuantizedKVCache)
