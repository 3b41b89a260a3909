"""The checkpoint key: every output-changing field changes it; what is never checkpointed (plain data)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxq.engine.checkpoint_key import checkpoint_key, is_due, not_checkpointed
from mlxq.engine.types import GrammarSpec, Request, SamplingParams

BASE = Request("a", [1, 2, 3], SamplingParams(temperature=0.7, seed=3, logit_bias={5: 1.0, 2: -1.0}), 100,
               stop=("x",))


def digest(request: Request, kv: str = "native") -> str:
    return checkpoint_key(request, kv).digest


def test_the_request_id_and_arrival_do_not_change_the_key():
    other = replace(BASE, request_id="b", submitted_at=BASE.submitted_at + 5, snapshot_at=2, deterministic=True)
    assert digest(other) == digest(BASE)
    reordered = replace(BASE, params=replace(BASE.params, logit_bias={2: -1.0, 5: 1.0}))
    assert digest(reordered) == digest(BASE)


@pytest.mark.parametrize("change", [
    {"prompt_ids": [1, 2, 4]}, {"max_tokens": 101}, {"stop": ("y",)}, {"stop": ()}, {"ignore_eos": True},
    {"namespace": "adapter-a"}, {"adapter": "lora-1"},
])
def test_every_request_field_that_changes_the_output_changes_the_key(change):
    assert digest(replace(BASE, **change)) != digest(BASE)


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.8), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.1),
    ("repetition_context_size", 21), ("presence_penalty", 0.5), ("presence_context_size", 7),
    ("frequency_penalty", 0.5), ("frequency_context_size", 7), ("logit_bias", {5: 2.0}), ("logit_bias", None),
    ("xtc_probability", 0.5), ("xtc_threshold", 0.2), ("seed", 4),
])
def test_every_sampling_field_changes_the_key(field, value):
    assert digest(replace(BASE, params=replace(BASE.params, **{field: value}))) != digest(BASE)


def test_the_kv_scheme_changes_the_key():
    assert digest(BASE, kv="q8") != digest(BASE)


@pytest.mark.parametrize("change, reason", [
    ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "logprobs"), ({"num_choices": 2}, "n > 1"),
    ({"grammar": GrammarSpec("json_object", "{}")}, "grammar"),
    ({"params": SamplingParams(temperature=0.7)}, "without a seed"),
])
def test_what_a_replay_cannot_rebuild_is_not_checkpointed(change, reason):
    assert reason in not_checkpointed(replace(BASE, **change))


def test_greedy_and_seeded_requests_are_checkpointed():
    assert not_checkpointed(BASE) is None
    assert not_checkpointed(replace(BASE, params=SamplingParams())) is None


def test_a_checkpoint_is_due_every_interval_tokens():
    assert [n for n in range(1, 50) if is_due(n, 16, 16 * ((n - 1) // 16))] == [16, 32, 48]
    assert not is_due(1000, 0, 0)
    assert is_due(21, 16, 5) and not is_due(20, 16, 5)  # a restore at 5 tokens restarts the count
