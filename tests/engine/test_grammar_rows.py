"""Grammar rows: output inside the grammar, in both lanes, without disturbing the rows beside them."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import llguidance
import pytest

from mlxq.engine.faults import Evaluator, FaultInjector
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
from mlxq.engine.serial import run_serial
from mlxq.engine.types import FinishReason, GrammarSpec, Request, SamplingParams
from mlxq.golden.cases import LONG, SHORT
from mlxq.kv.projection import measure_footprint
from mlxq.kv.scheme import NATIVE
from tests.engine.test_batch_parity import PROCESSORS, SEEDED, run_schedule, solo_tokens

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


@pytest.mark.parametrize("arch,token0_in_decode", [("llama", True), ("llama", False), ("qwen3_next", True)],
                         ids=["llama-token0-in-decode", "llama-token0-forward", "qwen3_next-token0-in-decode"])
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


def test_grammar_rows_with_and_without_processors_share_a_step(load_tiny):
    """The step masks its grammar rows together; a grammar row with logits processors masks after them,
    as the serial lane does. Both equal their serial runs, and the free row beside them is unchanged."""
    model, tokenizer = load_tiny("llama")
    short, long = tokenizer.encode(SHORT), tokenizer.encode(LONG)
    grammar = schema_grammar(SCHEMA)
    arrivals = [
        (0, Request("json-processors", short, PROCESSORS, 120, grammar=grammar)),
        (0, Request("free-seeded", long, SEEDED, 30)),
        (0, Request("json-a", long, SamplingParams(temperature=0.8, seed=1), 120, grammar=grammar)),
        (1, Request("json-b", short[:9], SamplingParams(temperature=0.8, seed=2), 120, grammar=grammar)),
    ]
    batched, widest = run_schedule(model, tokenizer, arrivals, prompt_concurrency=4)
    assert widest == 4
    for _, request in arrivals:
        tokens, finished = solo(model, tokenizer, request)
        assert batched[request.request_id] == tokens, request.request_id
        if request.grammar is not None:
            assert finished == FinishReason.STOP
            assert_valid(tokenizer, tokens)


def test_preempted_grammar_rows_resume_where_they_stopped(load_tiny):
    """Allocation faults drop every row's KV (engine/faults.py injects MLX's own error): grammar rows are
    recomputed from their tokens, their matchers continue, and the output equals an undisturbed run."""
    model, tokenizer = load_tiny("llama")
    grammar = schema_grammar(SCHEMA)
    requests = [Request(f"json-{i}", tokenizer.encode(SHORT)[: 9 + i], SamplingParams(temperature=0.8, seed=i), 120,
                        grammar=grammar) for i in range(3)] + [Request("free", tokenizer.encode(LONG), SEEDED, 40)]
    config = SchedulerConfig(8, 4, 2048, None, True)
    # Pairs fail an evaluation and its retry (rows preempted); singles fail once (the retry clears it).
    plan = {"decode": frozenset({6, 7, 15, 21, 22, 40, 41})}
    finished: dict[str, list[int]] = {}
    scheduler = BatchScheduler(model, tokenizer, measure_footprint(model, 2048, NATIVE), config,
                               on_finish=lambda row: finished.__setitem__(row.request.request_id, row.output.tokens),
                               evaluator=Evaluator(FaultInjector(plan)))
    for request in requests:
        scheduler.add(request, lambda e: None)
    for _ in range(2000):
        if scheduler.is_idle:
            break
        scheduler.step()
    assert scheduler.faults.counters.preemptions >= 2 and scheduler.faults.counters.failed_out_of_memory == 0
    for request in requests:
        tokens, _ = solo(model, tokenizer, request)
        assert finished[request.request_id] == tokens, request.request_id
