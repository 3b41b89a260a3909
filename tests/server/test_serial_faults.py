"""Allocation faults in the serial lane (`--batch 1`): retried, requeued, resumed exactly.

MLXQ_FAULT_INJECT raises MLX's own CUDA allocation error at chosen draws and
prefill chunks of mlx-lm's loop (engine/serial.py); everything else is the
real server and real clients, and an undisturbed server is the reference:
greedy, seeded sampled (with penalties, and with XTC, whose hidden draw uses
MLX's global key) and grammar-constrained requests answer exactly as it does.
"""

from __future__ import annotations

import json
import time

import httpx

from tests.conftest import ServerProcess
from tests.server.test_memory_faults import PROMPTS, SCHEMA, _json_answer, _stream

ARGS = ("--batch", "1", "--prefill-step-size", "8", "--log-level", "warning")
SAMPLING = [
    {},  # greedy
    {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 24},
    {"temperature": 0.8, "seed": 8, "max_tokens": 24, "repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"temperature": 1.0, "seed": 9, "max_tokens": 24, "xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"temperature": 0.7, "seed": 10, "max_tokens": 20},
]
# Where each planned fault lands (the requests run in turn; "again" = the retry failed too: requeued):
# greedy: prefill 3, again at 4; draw 4, again at the resumed loop's first (token0 2); draw 12.
# top_p: draw 30. Penalties: draw 45, again at 46; draw 60. XTC: draw 75, again at token0 12;
# draw 90. Plain sampled: draw 105. Grammar (greedy, JSON): draws 120 and 135.
FAULTS = ("prefill:3-4,decode:4,token0:2,decode:12,decode:30,decode:45-46,decode:60,decode:75,token0:12,"
          "decode:90,decode:105,decode:120,decode:135")


def _one_after_another(url: str) -> list:
    """Each kind of request in turn, so each planned fault lands in the same request every run."""
    answers = [_stream(url, prompt, **sampling) for prompt, sampling in zip(PROMPTS, SAMPLING, strict=False)]
    return [*answers, _json_answer(url, PROMPTS[-1])]


def test_serial_requests_resume_after_faults_as_an_undisturbed_run(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS) as server:
        reference = _one_after_another(server.url)
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS, env={"MLXQ_FAULT_INJECT": FAULTS}) as server:
        answers = _one_after_another(server.url)
        stats = httpx.get(server.url + "/stats").json()
    faults = stats["batch"]["faults"]
    assert stats["batch"]["mode"] == "off" and stats["engine"]["requests_failed"] == 0
    assert (faults["memory_faults"], faults["preemptions"], faults["retried_ok"]) == (15, 4, 11)
    assert faults["failed_out_of_memory"] == 0
    assert all(a["finish"] == "length" for a in answers[:-1])
    assert len({a["text"] for a in reference[:-1]}) == len(SAMPLING)
    assert answers == reference  # token for token: nothing lost, nothing emitted twice, same draws
    assert set(json.loads(answers[-1])) == set(SCHEMA["properties"])  # the grammar held across the resume


def test_a_request_requeued_too_often_fails_clearly_and_the_server_goes_on(tiny_model_dirs):
    # Draw 2 fails, then the first draw of every resumed loop: requeued 8 times, then it fails.
    env = {"MLXQ_FAULT_INJECT": "decode:2,token0:2-10"}
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS, env=env) as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        after = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        stats = httpx.get(server.url + "/stats").json()
    assert failed.status_code == 500 and "out of memory after 8 requeues" in failed.json()["error"]["message"]
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    faults = stats["batch"]["faults"]
    assert faults["failed_out_of_memory"] == 1 and faults["preemptions"] == 8
    assert stats["engine"]["requests_failed"] == 1 and stats["engine"]["requests_finished"] == 1


def test_a_client_that_leaves_while_its_request_waits_to_resume_cancels_it(tiny_model_dirs):
    # As above, but the client leaves after ~2.5 s, while the request waits out a back-off (they
    # add up to 7 s before the 8th requeue would fail it); the next request finishes.
    env = {"MLXQ_FAULT_INJECT": "decode:2,token0:2-10"}
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), *ARGS, env=env) as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # token 0 went out before the faults
            time.sleep(2.5)
        after = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=120)
        stats = httpx.get(server.url + "/stats").json()
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    engine = stats["engine"]
    assert (engine["requests_cancelled"], engine["requests_failed"], engine["requests_finished"]) == (1, 0, 1)
    assert stats["batch"]["faults"]["preemptions"] >= 2
