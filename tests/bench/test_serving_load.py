"""The load generator: metric definitions on a server with known timings, then a real mlxq."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from mlxq.bench.client import LoadConfig, arrival_offsets, run_load
from mlxq.bench.datasets import make_workload
from mlxq.bench.metrics import summarize
from mlxq.bench.records import read_records
from mlxq.bench.serving_load import Workload, sweep
from mlxq.cli.main import app
from tests.conftest import free_port, wait_healthy

TTFT_S = 0.20  # the synthetic server's time to first chunk
ITL_S = 0.05  # and between chunks
TOKENS = 6


SEEN_MESSAGES: list[list[dict]] = []  # every request's messages, as the synthetic server received them


async def fake_chat(request: Request):
    body = await request.json()
    SEEN_MESSAGES.append(body["messages"])
    if body["messages"][-1]["content"].startswith("FAIL"):
        return JSONResponse({"error": {"message": "nope"}}, status_code=500)

    async def events():
        await asyncio.sleep(TTFT_S)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(ITL_S)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        yield f"data: {json.dumps(final)}\n\n"
        usage = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": TOKENS,
                                          "prompt_tokens_details": {"cached_tokens": 25}}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def fake_health(request: Request):
    return JSONResponse({"status": "ok"})


@pytest.fixture(scope="module")
def synthetic_server():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        Starlette(routes=[Route("/v1/chat/completions", fake_chat, methods=["POST"]),
                          Route("/health", fake_health)]),
        host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    yield url
    server.should_exit = True
    thread.join(10)


def test_metric_definitions_match_known_timings(synthetic_server):
    cfg = LoadConfig(url=synthetic_server, max_tokens=TOKENS)
    work = make_workload("random", 4, 10)
    records = asyncio.run(run_load(cfg, work, concurrency=4))
    s = summarize(records)
    assert s["completed"] == 4 and s["failed"] == 0
    # TTFT: send -> first content chunk; the server waits TTFT_S before it.
    assert TTFT_S <= s["ttft_ms"]["p50"] / 1000 < TTFT_S + 0.15
    # ITL: pooled gaps between content chunks, (TOKENS - 1) per request.
    assert s["itl_ms"]["count"] == 4 * (TOKENS - 1)
    assert ITL_S * 0.9 <= s["itl_ms"]["p50"] / 1000 < ITL_S + 0.04
    # TPOT = (E2EL - TTFT) / (tokens - 1) per request; tokens come from usage.
    for r in records:
        assert r.output_tokens == TOKENS
        assert r.tpot == pytest.approx((r.e2el - r.ttft) / (TOKENS - 1))
    assert s["tpot_ms"]["p50"] / 1000 >= ITL_S * 0.9
    # Throughput is over first send -> last completion.
    assert s["output_throughput_tok_s"] == pytest.approx(4 * TOKENS / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(4 / s["duration_s"])
    assert s["cached_token_ratio"] == pytest.approx(0.25)
    # Concurrency 4 with 4 requests: they overlap, so the run is about one request long.
    assert s["duration_s"] < 2 * (TTFT_S + (TOKENS - 1) * ITL_S)


def test_no_server_timing_from_a_server_without_mlxq_stats(synthetic_server):
    doc = asyncio.run(sweep(LoadConfig(url=synthetic_server, max_tokens=TOKENS), Workload(num_requests=2, warmup=0),
                            [1], quiet=True))
    assert doc["a"][0]["completed"] == 2 and doc["a"][0]["server_timing"] is None


def test_concurrency_bounds_requests_in_flight(synthetic_server):
    cfg = LoadConfig(url=synthetic_server, max_tokens=TOKENS)
    records = asyncio.run(run_load(cfg, make_workload("random", 4, 10), concurrency=1))
    records.sort(key=lambda r: r.sent_at)
    for prev, nxt in zip(records, records[1:], strict=False):
        assert nxt.sent_at >= prev.done_at  # serialized


def test_failures_are_counted_with_their_first_error(synthetic_server):
    from mlxq.bench.datasets import Conversation

    cfg = LoadConfig(url=synthetic_server, max_tokens=TOKENS)
    work = [Conversation(None, ["FAIL please"]), Conversation(None, ["fine"])]
    s = summarize(asyncio.run(run_load(cfg, work, concurrency=2)))
    assert s["completed"] == 1 and s["failed"] == 1
    assert "HTTP 500" in s["errors"][0]


def test_poisson_arrivals_have_the_requested_rate():
    offsets = arrival_offsets(2000, rate=50.0, burstiness=1.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert 2000 / offsets[-1] == pytest.approx(50.0, rel=0.1)
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_datasets_shapes():
    shared = make_workload("shared-prefix", 8, 50, num_groups=2)
    assert len({c.system for c in shared}) == 2 and len(shared) == 8
    multi = make_workload("multi-turn", 9, 20, turns=3)
    assert len(multi) == 3 and all(len(c.turns) == 3 for c in multi)
    assert make_workload("random", 3, 5, seed=1)[0].turns == make_workload("random", 3, 5, seed=1)[0].turns
    agents = make_workload("agents", 10, 30, turns=5)
    assert len(agents) == 2 and len({c.system for c in agents}) == 1 and all(len(c.turns) == 5 for c in agents)


def test_kept_systems_change_only_the_questions():
    # Two rounds' seeds with the systems drawn from one seed: the prefix repeats, the questions do not.
    one, two = (make_workload("shared-prefix", 4, 50, seed=s, num_groups=1, system_seed=7) for s in (1, 2))
    assert one[0].system == two[0].system and one[0].turns != two[0].turns
    fresh = make_workload("shared-prefix", 4, 50, seed=2, num_groups=1)
    assert fresh[0].system != one[0].system
    agents = [make_workload("agents", 3, 30, seed=s, turns=3, system_seed=7)[0] for s in (1, 2)]
    assert agents[0].system == agents[1].system and agents[0].turns != agents[1].turns


def test_cli_against_real_mlxq(llama_server, tmp_path):
    out, png, rec = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.jsonl.gz"
    result = CliRunner().invoke(app, [
        "bench", "serving-load", "--url", llama_server.url, "--concurrency", "1,2", "--num-requests", "4",
        "--prompt-len", "20", "--max-tokens", "8", "--ignore-eos", "--dataset", "multi-turn", "--turns", "2",
        "--json", str(out), "--records", str(rec), "--plot", str(png), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.count("server: decode step") == 2  # one line per level
    doc = json.loads(out.read_text())
    assert [r["concurrency"] for r in doc["a"]] == [1, 2]
    assert all("records" not in run for run in doc["a"])  # summaries only; records went to --records
    all_records = read_records(rec)
    for index, run in enumerate(doc["a"]):
        run["records"] = [r for r in all_records if r["measurement"] == index]
        assert {r["concurrency"] for r in run["records"]} == {run["concurrency"]}
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["total_output_tokens"] == 4 * 8  # ignore_eos: exactly max_tokens
        assert run["ttft_ms"]["p50"] > 0 and run["output_throughput_tok_s"] > 0
        assert len(run["records"]) == 4
        # Turn 2 carries turn 1's history, so its prompt is longer.
        by_tag: dict = {}
        for rec in sorted(run["records"], key=lambda r: r["sent_at"]):
            by_tag.setdefault(rec["tag"], []).append(rec["prompt_tokens"])
        assert all(p[1] > p[0] for p in by_tag.values())
        assert sorted(rec["turn"] for rec in run["records"]) == [0, 0, 1, 1]
        assert run["ttft_by_turn_ms"]["first"]["count"] == 2 and run["ttft_by_turn_ms"]["later"]["count"] == 2
        # mlxq's own account of the measurement (its /stats, read around it): one decode step
        # per token after each request's first (CPU: token 0 from the joiner's forward) at
        # c=1; fewer when rows share steps.
        timing = run["server_timing"]
        assert 0 < timing["steps"] <= 4 * 8
        if run["concurrency"] == 1:
            assert timing["steps"] == 4 * 8
        assert abs(sum(timing["busy_share"].values()) - 1) < 1e-3
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_compare_reports_ratios(llama_server):
    result = CliRunner().invoke(app, [
        "bench", "serving-load", "--url", llama_server.url, "--compare", llama_server.url, "--concurrency", "2",
        "--num-requests", "2", "--prompt-len", "10", "--max-tokens", "4", "--rounds", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "B / A" in result.output


def test_unreachable_server_fails_at_once_with_exit_1():
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["bench", "serving-load", "--url", url, "--num-requests", "200", "--quiet"])
    assert result.exit_code == 1
    assert f"cannot reach {url}: ConnectError" in result.output
    assert "serving-load" not in result.output  # no level was run


def test_fresh_prompts_do_not_repeat_across_rounds(llama_server, tmp_path):
    def cached_ratios(*extra):
        out = tmp_path / f"f{len(extra)}.json"
        result = CliRunner().invoke(app, [
            "bench", "serving-load", "--url", llama_server.url, "--endpoint", "completions", "--concurrency", "2",
            "--num-requests", "4", "--prompt-len", "40", "--max-tokens", "4", "--rounds", "2", "--warmup", "0",
            "--seed", "5", "--json", str(out), "--quiet", *extra])
        assert result.exit_code == 0, result.output
        return [run["cached_token_ratio"] for run in json.loads(out.read_text())["a"]]

    repeated = cached_ratios("--repeat-prompts")
    fresh = cached_ratios()  # the default
    assert repeated[1] > 0.8  # the second round's prompts were the first round's
    assert max(fresh) < 0.3


def test_question_len_sets_each_requests_own_words(synthetic_server):
    SEEN_MESSAGES.clear()
    result = CliRunner().invoke(app, [
        "bench", "serving-load", "--url", synthetic_server, "--concurrency", "1", "--num-requests", "3",
        "--prompt-len", "30", "--max-tokens", str(TOKENS), "--dataset", "shared-prefix", "--num-groups", "1",
        "--question-len", "40", "--warmup", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    assert len(SEEN_MESSAGES) == 3
    systems = {messages[0]["content"] for messages in SEEN_MESSAGES}
    assert len(systems) == 1 and len(next(iter(systems)).split()) >= 30  # one shared system prompt
    assert [len(messages[-1]["content"].split()) for messages in SEEN_MESSAGES] == [40, 40, 40]
