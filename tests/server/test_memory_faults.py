"""Allocation faults in a real batch: retried, then rows preempted and recomputed, never a failed request.

MLXQ_FAULT_INJECT makes the engine raise MLX's own CUDA allocation error at
chosen evaluations (engine/faults.py); everything else is the real server,
real concurrent clients, and an undisturbed server as the reference.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ServerProcess

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor".split()
# Prompts of different lengths (several prefill chunks at --prefill-step-size 8), answered together.
PROMPTS = [" ".join(WORDS[(3 * i) % len(WORDS):] + WORDS[: 5 * i]) for i in range(6)]
ARGS = ("--batch", "6", "--prompt-concurrency", "4", "--prefill-step-size", "8", "--log-level", "warning")
# Decode evaluations 4 and 5 fail (the retry too: every running row is requeued), 12 fails once (the
# retry clears it); prefill evaluations 3-4 and 9-10, and token 0 evaluations 2-3, likewise.
FAULTS = "decode:4-5,decode:12,decode:18-19,prefill:3-4,prefill:9-10,token0:2-3"


def _stream(url: str, prompt: str, **sampling) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True, **sampling}
    text, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("choices"):
                text.append(event["choices"][0]["text"])
                finish = event["choices"][0].get("finish_reason") or finish
    return {"text": "".join(text), "finish": finish}


def _burst(url: str) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _stream(url, p), PROMPTS))


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dirs) -> list[dict]:
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS) as server:
        return _burst(server.url)


def test_injected_allocation_faults_cost_no_request_and_no_token(tiny_model_dirs, undisturbed):
    env = {"MLXQ_FAULT_INJECT": FAULTS}
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS, env=env) as server:
        answers = _burst(server.url)
        stats = httpx.get(server.url + "/stats").json()
        metrics = httpx.get(server.url + "/metrics").text
    assert all(a["finish"] == "length" for a in answers)
    assert answers == undisturbed  # token for token: nothing lost, nothing emitted twice
    faults = stats["batch"]["faults"]
    assert stats["engine"]["requests_failed"] == 0 and stats["engine"]["requests_finished"] == len(PROMPTS)
    assert faults["preemptions"] >= 1 and faults["retried_ok"] >= 1 and faults["failed_out_of_memory"] == 0
    assert faults["memory_faults"] >= 5
    assert stats["batch"]["preempted_rows"] == 0 and stats["batch"]["active_rows"] == 0
    preemptions = [line for line in metrics.splitlines() if line.startswith("mlxq:num_preemptions_total")]
    assert preemptions and float(preemptions[0].split()[-1]) == faults["preemptions"]


# Seeded sampled rows: each keeps its own PRNG key through a preemption; two also carry penalties
# (processors that see the row's history, rebuilt when its KV is recomputed).
SEEDED = [{"temperature": 0.9, "top_p": 0.95, "seed": 11 + i, "max_tokens": 24,
           **({"repetition_penalty": 1.3, "presence_penalty": 0.5} if i % 3 == 0 else {})}
          for i in range(len(PROMPTS))]


def _seeded_burst(url: str) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda job: _stream(url, job[0], **job[1]), zip(PROMPTS, SEEDED, strict=True)))


@pytest.fixture(scope="module")
def seeded_reference(tiny_model_dirs) -> list[dict]:
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS) as server:
        return _seeded_burst(server.url)


@pytest.mark.parametrize("faults", ["decode:4-5,decode:12,decode:18-19,token0:2-3", "decode:9-10,prefill:3-4"])
def test_seeded_sampled_rows_resume_with_the_draws_of_an_undisturbed_run(tiny_model_dirs, seeded_reference, faults):
    reference = seeded_reference
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS, env={"MLXQ_FAULT_INJECT": faults}) as server:
        answers = _seeded_burst(server.url)
        stats = httpx.get(server.url + "/stats").json()
    assert stats["batch"]["faults"]["preemptions"] >= 1 and stats["engine"]["requests_failed"] == 0
    assert len({a["text"] for a in reference}) == len(PROMPTS)  # sampled, not all one greedy answer
    assert answers == reference


def test_a_bad_fault_spec_stops_the_server_at_start(tiny_model_dirs):
    server = ServerProcess("--model", str(tiny_model_dirs["llama"]), env={"MLXQ_FAULT_INJECT": "decode:x"})
    assert server.proc.wait(60) != 0
    assert "MLXQ_FAULT_INJECT" in server.proc.stdout.read()


def test_rows_are_preempted_before_memory_runs_out(tiny_model_dirs, undisturbed):
    # 4 MB: the tiny llama's 3.2 MB of weights and the KV of about one row (2 KiB per token, 256-token
    # blocks): every decode step with more rows sheds the newest, which resume later.
    args = (*ARGS, "--memory-limit", "4MB", "--prompt-cache", "0")
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *args) as server:
        # Whether a burst is shed or queued depends on arrival: a request that starts decoding alone
        # makes the others wait for memory room at admission (no preemption needed). Bursts repeat
        # until one was admitted together and shed; every burst must equal the undisturbed answers.
        for _ in range(4):
            assert _burst(server.url) == undisturbed
            stats = httpx.get(server.url + "/stats").json()
            if stats["batch"]["faults"]["preemptions"]:
                break
    faults = stats["batch"]["faults"]
    assert faults["preemptions"] >= 1 and faults["memory_faults"] == 0  # shed before, not after, a fault
    assert stats["engine"]["requests_failed"] == 0 and stats["memory"]["mlx_memory_limit_bytes"] == 4 * 10**6


SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"], "additionalProperties": False}


def _json_answer(url: str, prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 48, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_grammar_rows_recomputed_after_a_preemption_keep_their_grammar(tiny_model_dirs):
    """A preempted row feeds its last token again: its matcher must not consume that token twice."""

    def burst(url: str) -> list:  # grammar rows and plain rows in one batch
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            jobs = [pool.submit(_json_answer if i < 3 else _stream, url, p) for i, p in enumerate(PROMPTS)]
            return [job.result() for job in jobs]

    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS) as server:
        reference = burst(server.url)
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS,
                       env={"MLXQ_FAULT_INJECT": "decode:6-7,decode:15-16"}) as server:
        answers = burst(server.url)
        faults = httpx.get(server.url + "/stats").json()["batch"]["faults"]
    assert faults["preemptions"] >= 1
    assert answers == reference
    for text in answers[:3]:
        json.loads(text)  # complete JSON: the grammar held across the recomputation
