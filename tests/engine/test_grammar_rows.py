"""Grammar rows: output inside the grammar, in both lanes, without disturbing the rows beside them."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import llguidance
import pytest

from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.serial import run_serial
from mlxq.engine.types import FinishReason, GrammarSpec, Request, SamplingParams
from mlxq.golden.cases import LONG, SHORT
from tests.engine.test_batch_parity import SEEDED, run_schedule, solo_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def schema_grammar(schema: dict) -> GrammarSpec:
    text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    return GrammarSpec("json_schema", text)


def solo(model, tokenizer, request: Request) -> tuple[list[int], FinishReason]:
    fresh = dataclasses.replace(request, cancelled=type(request.cancelled)())
    output = run_serial(model, tokenizer, fresh, lambda e: None, prefill_step_size=2048)
    return output.tokens, output.finished


def assert_valid(tokenizer, tokens: list[int]) -> None:
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)


def test_serial_lane_output_follows_the_schema_and_ends_at_eos(load_tiny):
    model, tokenizer = load_tiny("llama")
    timing = GrammarTiming()
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=5)):
        request = Request("g", tokenizer.encode(SHORT), params, 200, grammar=schema_grammar(SCHEMA))
        output = run_serial(model, tokenizer, request, lambda e: None, prefill_step_size=2048,
                            grammar_timing=timing)
        assert output.finished == FinishReason.STOP  # the grammar completed, so only EOS was allowed
        assert_valid(tokenizer, output.tokens)
    assert timing.masks > 0


@pytest.mark.parametrize("token0_in_decode", [True, False], ids=["token0-in-decode", "token0-forward"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_grammar_rows_batch_with_free_rows_and_equal_their_serial_runs(arch, token0_in_decode, load_tiny):
    model, tokenizer = load_tiny(arch)
    short, long = tokenizer.encode(SHORT), tokenizer.encode(LONG)
    grammar = schema_grammar(SCHEMA)
    arrivals = [
        (0, Request("free-greedy", long, SamplingParams(), 40)),
        (0, Request("json-greedy", short, SamplingParams(), 120, grammar=grammar)),
        (2, Request("free-seeded", short, SEEDED, 30)),
        (3, Request("json-seeded", long, SamplingParams(temperature=0.8, seed=7), 120, grammar=grammar)),
        (6, Request("json-late", short[:7], SamplingParams(temperature=0.8, seed=8), 120, grammar=grammar)),
    ]
    batched, widest = run_schedule(model, tokenizer, arrivals, token0_in_decode=token0_in_decode)
    assert widest >= 3
    for _, request in arrivals:
        if request.grammar is None:
            # Parity: a grammar row beside it changes nothing in a free row.
            assert batched[request.request_id] == solo_tokens(model, tokenizer, request, 2048), request.request_id
        else:
            tokens, finished = solo(model, tokenizer, request)
            assert batched[request.request_id] == tokens, request.request_id  # serial lane == batch lane
            assert finished == FinishReason.STOP
            assert_valid(tokenizer, tokens)
