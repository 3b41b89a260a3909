"""Operations: /metrics adds up, /health means progress, request logs, limits, exposure warning."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import mlx.core as mx
import pytest

from mlxq.engine.engine import Engine, EngineConfig
from mlxq.models.loader import load_model
from mlxq.server.config import ServerConfig
from mlxq.server.state import ServerState
from tests.conftest import InProcessServer, ServerProcess


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value} (comments and _created lines dropped)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("#") or "_created" in line or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def ops_server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-format", "json",
                       "--max-request-bytes", "64KiB", "--max-tokens-limit", "200",
                       "--max-prompt-tokens", "1000", "--max-tokens-policy", "reject") as server:
        yield server


async def _completion(url: str, body: dict) -> dict:
    async with httpx.AsyncClient(timeout=60) as client:
        return (await client.post(url + "/v1/completions", json=body)).json()


def test_metrics_add_up_to_the_requests_sent(ops_server):
    url = ops_server.url
    bodies = [{"prompt": [1, 2, 3 + i], "max_tokens": 5 + i, "ignore_eos": True} for i in range(12)]

    async def run_all():
        return await asyncio.gather(*(_completion(url, b) for b in bodies))

    before = scrape(url)
    results = asyncio.run(run_all())
    after = scrape(url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    generated = sum(r["usage"]["completion_tokens"] for r in results)
    assert generated == sum(b["max_tokens"] for b in bodies)
    assert delta('mlxq:request_success_total{finished_reason="length"}') == 12
    assert delta("mlxq:generation_tokens_total") == generated
    assert delta("mlxq:prompt_tokens_total") == 12 * 3
    assert delta("mlxq:time_to_first_token_seconds_count") == 12
    assert delta("mlxq:e2e_request_latency_seconds_count") == 12
    assert delta("mlxq:request_queue_time_seconds_count") == 12
    # One inter-token gap per token after the first (EOS ignored, so exactly max_tokens tokens).
    assert delta("mlxq:inter_token_latency_seconds_count") == generated - 12
    assert delta("mlxq:request_generation_tokens_sum") == generated
    assert after["mlxq:num_requests_waiting"] == 0 and after["mlxq:kv_cache_usage_bytes"] == 0


def test_gauges_show_work_in_flight(ops_server):
    url = ops_server.url
    generated = lambda: httpx.get(url + "/stats").json()["engine"]["generated_tokens"]  # noqa: E731
    before = generated()
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        during = scrape(url)
        generated_during = generated()  # tokens count as they are handed out (the dashboard's tok/s)
        for _ in lines:
            pass
    assert before < generated_during < before + 200
    assert during["mlxq:num_requests_running"] == 1
    assert during["mlxq:kv_cache_usage_bytes"] > 0
    deadline = time.monotonic() + 10
    while scrape(url)["mlxq:num_requests_running"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_metrics_count_cancelled_requests(ops_server):
    url = ops_server.url
    before = scrape(url)
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while scrape(url).get('mlxq:request_success_total{finished_reason="cancelled"}', 0) <= \
            before.get('mlxq:request_success_total{finished_reason="cancelled"}', 0):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_limits_refuse_with_clear_errors(ops_server):
    url = ops_server.url + "/v1/completions"
    big = httpx.post(url, content=b'{"prompt": "' + b"a" * 70_000 + b'"}',
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    over = httpx.post(url, json={"prompt": [1, 2], "max_tokens": 201})
    assert over.status_code == 400 and over.json()["error"]["code"] == "max_tokens_too_large"
    beyond = httpx.post(url, json={"prompt": [1] * 999, "max_tokens": 4000})  # the context is 4096
    assert beyond.status_code == 400 and beyond.json()["error"]["code"] == "context_length_exceeded"
    long = httpx.post(url, json={"prompt": [1] * 1001, "max_tokens": 2})
    assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
    # Without max_tokens, the default is capped by --max-tokens-limit.
    ok = httpx.post(url, json={"prompt": [1, 2], "ignore_eos": True}).json()
    assert ok["usage"]["completion_tokens"] == 200
    assert httpx.get(ops_server.url + "/health").status_code == 200


def test_ready_and_metrics_endpoints(ops_server):
    assert httpx.get(ops_server.url + "/ready").json() == {"ready": True}
    r = httpx.get(ops_server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE mlxq:time_to_first_token_seconds histogram" in r.text


def test_stats_split_each_decode_step(ops_server):
    """/stats.batch.decode_timing: one step per token of a lone request (CPU: token 0 comes
    from the joiner's own forward), and the step's parts within its time; phase_timing: the
    prefill and join around them."""
    def timing():
        return httpx.get(ops_server.url + "/stats").json()["batch"]["decode_timing"]

    before, scraped_before = timing(), scrape(ops_server.url)
    reply = asyncio.run(_completion(ops_server.url, {"prompt": [5, 6, 7], "max_tokens": 16, "ignore_eos": True}))
    after, scraped = timing(), scrape(ops_server.url)
    assert reply["usage"]["completion_tokens"] == 16
    assert after["steps"] - before["steps"] == 16
    assert after["totals"]["cycles"] - before["totals"]["cycles"] == 15
    parts = sum(after["totals"][k] - before["totals"][k] for k in ("build_s", "submit_s", "device_wait_s"))
    assert 0 < parts <= after["totals"]["step_s"] - before["totals"]["step_s"]
    # /metrics exports the same counters (Prometheus: rate() of a part over rate() of the steps).
    assert scraped["mlxq:decode_steps_total"] - scraped_before["mlxq:decode_steps_total"] == 16
    by_part = {part: scraped[f'mlxq:decode_step_seconds_total{{part="{part}"}}']
               for part in ("build", "submit", "device_wait", "output")}
    assert abs(sum(by_part.values()) - after["totals"]["step_s"]) < 1e-3
    # The prompt's one prefill chunk and its join, in /stats and /metrics.
    batch = httpx.get(ops_server.url + "/stats").json()["batch"]
    phases = batch["phase_timing"]
    assert phases["prefill_iterations"] >= 1 and phases["joins"] >= 1
    # Whole-row KV copies around joins, counted (tests/engine/test_wave_join.py checks the counts).
    assert set(batch["row_copies"]) == {"kept", "broadcast", "gathered", "extracted", "batch_extends", "extended_rows",
                                        "referenced"}
    assert abs(sum(phases["busy_share"].values()) - 1) < 1e-3
    assert set(phases["batched_prefill"]) == {"forwards", "tokens", "positions", "padding_share"}
    assert scraped['mlxq:scheduler_phase_seconds_total{phase="prefill"}'] == phases["totals"]["prefill_s"]


def test_request_log_lines_are_json_without_prompts(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-format", "json") as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "SECRET-PROMPT", "max_tokens": 3})
        server.stop()
        logs = server.proc.stdout.read()
    every = [json.loads(line) for line in logs.splitlines() if line.strip()]  # each line is JSON (jq reads it)
    assert {"time", "level", "logger"} <= set(every[0])
    assert any(e["logger"].startswith("uvicorn") for e in every)  # uvicorn's own lines too
    assert "HTTP/1.1" not in logs  # no access lines: /health was polled, the request is logged once
    lines = [e for e in every if e["logger"] == "mlxq.requests"]
    assert len(lines) == 1
    assert {"id", "lane", "prompt_tokens", "cached_tokens", "generated_tokens", "queue_ms", "ttft_ms", "decode_tok_s",
            "finish_reason"} <= set(lines[0])
    # The batch lane's way from admission to token 0, in phases that add up to ttft - queue.
    phases = {k: v for k, v in lines[0].items() if k.startswith("ttft_") and k != "ttft_ms"}
    assert lines[0]["lane"] == "continuous" and {"ttft_lease_ms", "ttft_prefill_ms", "ttft_join_ms"} <= set(phases)
    assert abs(sum(phases.values()) - (lines[0]["ttft_ms"] - lines[0]["queue_ms"])) < 1.0  # each rounded to 0.1
    assert 0 < lines[0]["parse_ms"] < 10_000  # received -> submitted: the body read, parsed and tokenized
    assert "SECRET-PROMPT" not in logs
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-prompts") as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "SECRET-PROMPT", "max_tokens": 3})
        server.stop()
        assert "SECRET-PROMPT" in server.proc.stdout.read()


def test_binding_beyond_loopback_without_a_key_warns(tiny_model_dirs):
    server = ServerProcess("--model", str(tiny_model_dirs["llama"]), "--host", "0.0.0.0")
    with server:
        pass
    assert "without --api-key" in server.proc.stdout.read()


class FatalError(BaseException):
    """Not an Exception: escapes the per-request handler, as a real fatal fault would."""


class FaultyModel:
    """The real model; prompts holding 9 kill the engine thread, prompts holding 8 stall it for 2 s."""

    def __init__(self, model):
        self._model = model

    def __call__(self, inputs, cache=None, **kw):
        if inputs.size > 1 and bool(mx.any(inputs == 9).item()):
            raise FatalError("injected fatal fault")
        if inputs.size > 1 and bool(mx.any(inputs == 8).item()):
            time.sleep(2.0)
        return self._model(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def faulty_server(model_dir, stall_timeout: float) -> InProcessServer:
    def load():
        loaded = load_model(str(model_dir))
        loaded.model = FaultyModel(loaded.model)
        return loaded

    return InProcessServer(ServerState(ServerConfig(stall_timeout_s=stall_timeout), Engine(load, EngineConfig())))


def test_health_turns_503_when_the_engine_makes_no_progress(tiny_model_dirs):
    with faulty_server(tiny_model_dirs["llama"], stall_timeout=0.5) as server:
        pending = httpx.AsyncClient(timeout=30)

        async def stalled_request_and_probe():
            request = asyncio.create_task(pending.post(server.url + "/v1/completions",
                                                       json={"prompt": [1, 8, 2], "max_tokens": 2}))
            await asyncio.sleep(1.2)
            async with httpx.AsyncClient() as probe:
                health = await probe.get(server.url + "/health")
            response = await request
            return health, response

        health, response = asyncio.run(stalled_request_and_probe())
        assert health.status_code == 503 and "no progress" in health.json()["reason"]
        assert response.status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


def test_health_turns_503_when_the_engine_thread_dies(tiny_model_dirs):
    with faulty_server(tiny_model_dirs["llama"], stall_timeout=30) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 9, 2], "max_tokens": 2}, timeout=30)
        assert r.status_code in (500, 503)
        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "injected fatal fault" in httpx.get(server.url + "/health").json()["reason"]
        assert httpx.get(server.url + "/ready").status_code == 503
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 503


def test_default_budgets_come_from_the_machine_and_off_removes_the_kv_cap(tiny_model_dirs):
    import httpx

    from tests.conftest import ServerProcess

    with ServerProcess("--model", str(tiny_model_dirs["llama"])) as server:
        stats = httpx.get(server.url + "/stats").json()
    assert 0 < stats["prompt_cache"]["max_bytes"] <= 8 * 10**9
    assert stats["batch"]["kv_budget_bytes"] > 0
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--kv-budget", "off") as server:
        assert httpx.get(server.url + "/stats").json()["batch"]["kv_budget_bytes"] is None
