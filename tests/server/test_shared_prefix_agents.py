"""Agents on one long system prompt decode with the prompt read once per step (--shared-prefix-attention).

A real batch server groups the rows that lease the same prompt-cache node
chain (engine/prefix_sharing.py); their greedy outputs equal a --batch 1
server's (the serial lane, mlx-lm's generate), token for token, also when a
row is cancelled mid-way and a late agent joins the running group (in
place, by reference), and with agents of two system prompts in one batch
(two groups); /metrics counts the decode steps that ran shared, and
``off`` runs none.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.server.test_agents_prefix_tree import messages, system_prompt

AGENTS = 12
MAX_TOKENS = 24


def ask(url: str, system: str, agent: int, max_tokens: int = MAX_TOKENS) -> str:
    body = {"messages": messages(system, agent), "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def wave(url: str, system: str, agents, max_tokens: int = MAX_TOKENS) -> list[str]:
    agents = list(agents)
    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(lambda agent: ask(url, system, agent, max_tokens), agents))


def shared_steps(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^mlxq:shared_prefix_decode_steps_total (\S+)$", text, re.M).group(1))


def serve(model_dir, *flags: str) -> ServerProcess:
    return ServerProcess("--model", str(model_dir), "--log-level", "warning", *flags)


def serial_outputs(model_dir, system: str, agents, max_tokens: int = MAX_TOKENS) -> list[str]:
    with serve(model_dir, "--batch", "1") as server:
        return [ask(server.url, system, agent, max_tokens) for agent in agents]


def test_twelve_agents_decode_shared_with_the_serial_lanes_output(tiny_model_dirs, load_tiny):
    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer, 600)
    model_dir = tiny_model_dirs["llama"]
    want = serial_outputs(model_dir, system, range(AGENTS))
    with serve(model_dir, "--batch", "12", "--shared-prefix-attention", "on") as server:
        got = wave(server.url, system, range(AGENTS))
        steps = shared_steps(server.url)
        stats = httpx.get(server.url + "/stats").json()["batch"]["shared_prefix"]
    assert got == want
    assert steps > 0 and stats["steps"] == steps and stats["groups_built"] >= 1, stats
    assert stats["mode"] == "on" and stats["declined"] is None and 0 < stats["share_of_steps"] <= 1


def test_agents_of_two_system_prompts_decode_in_two_groups(tiny_model_dirs, load_tiny):
    _, tokenizer = load_tiny("llama")
    first, second = system_prompt(tokenizer, 500), "Reviewers' rules. " + system_prompt(tokenizer, 400)
    model_dir = tiny_model_dirs["llama"]
    agents = [(first if i % 2 else second, i) for i in range(AGENTS)]
    with serve(model_dir, "--batch", "1") as server:
        want = [ask(server.url, system, agent) for system, agent in agents]
    with serve(model_dir, "--batch", "12", "--shared-prefix-attention", "on") as server:
        with ThreadPoolExecutor(AGENTS) as pool:
            got = list(pool.map(lambda pair: ask(server.url, *pair), agents))
        stats = httpx.get(server.url + "/stats").json()["batch"]["shared_prefix"]
    assert got == want
    assert stats["multi_group_steps"] > 0 and stats["groups_built"] >= 2, stats


def _cancel_after_tokens(url: str, system: str, agent: int, tokens: int, started: threading.Event) -> None:
    body = {"messages": messages(system, agent), "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen >= tokens:
                    break
    started.set()  # the stream is closed: the server cancels the row mid-way


def test_a_cancelled_row_and_a_late_joiner_keep_the_group_exact(tiny_model_dirs, load_tiny):
    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer, 600)
    model_dir = tiny_model_dirs["llama"]
    finishing = list(range(1, AGENTS)) + [AGENTS]  # agent 0 is cancelled; agent AGENTS joins late
    want = serial_outputs(model_dir, system, finishing, 48)
    with serve(model_dir, "--batch", "12", "--shared-prefix-attention", "on") as server:
        cancelled = threading.Event()
        with ThreadPoolExecutor(AGENTS + 1) as pool:
            canceller = pool.submit(_cancel_after_tokens, server.url, system, 0, 4, cancelled)
            early = [pool.submit(ask, server.url, system, agent, 48) for agent in finishing[:-1]]
            assert cancelled.wait(300)
            late = pool.submit(ask, server.url, system, AGENTS, 48)
            got = [f.result() for f in early] + [late.result()]
            canceller.result()
        steps = shared_steps(server.url)
        stats = httpx.get(server.url + "/stats").json()["batch"]["shared_prefix"]
    assert got == want
    assert steps > 0
    assert stats["rows_joined_in_place"] >= 1, stats  # the late agent joined the running group in place


def test_off_runs_no_shared_step(tiny_model_dirs, load_tiny):
    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer, 600)
    with serve(tiny_model_dirs["llama"], "--batch", "12", "--shared-prefix-attention", "off") as server:
        wave(server.url, system, range(4), 8)
        steps = shared_steps(server.url)
        stats = httpx.get(server.url + "/stats").json()["batch"]["shared_prefix"]
    assert steps == 0 and stats["steps"] == 0 and stats["mode"] == "off"
    assert stats["declined"] == "--shared-prefix-attention off"


def test_auto_on_the_cpu_never_shares_and_a_bad_mode_is_refused(tiny_model_dirs, load_tiny):
    import subprocess
    import sys

    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer, 200)
    with serve(tiny_model_dirs["llama"], "--batch", "4", "--shared-prefix-attention", "auto") as server:
        wave(server.url, system, range(4), 8)
        assert shared_steps(server.url) == 0
        stats = httpx.get(server.url + "/stats").json()["batch"]["shared_prefix"]
        metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r"^mlxq:shared_prefix_auto_declined_joins_total 0\.0$", metrics, re.M)
    assert stats["mode"] == "auto" and stats["declined"].startswith("auto: sharing measured no gain")
    assert stats["auto_declined_joins"] == 0 and stats["auto_last_declined"] is None  # never probed: nothing to gate
    bad = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(tiny_model_dirs["llama"]),
                          "--shared-prefix-attention", "always"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--shared-prefix-attention must be auto, on or off" in bad.stderr


@pytest.mark.slow  # six servers on three architectures: about 100 s on two cores
def test_rings_recurrent_layers_and_quantized_kv_follow_the_sharing_plan(tiny_model_dirs, load_tiny):
    """Sliding-window and recurrent layers stay per row, quantized KV shares its triples (CPU): same tokens."""
    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer, 200)
    for arch, flags in (("gemma3_text", ()), ("qwen3_next", ()), ("llama", ("--kv-quant", "8"))):
        with serve(tiny_model_dirs[arch], "--batch", "1", *flags) as server:
            want = [ask(server.url, system, agent, 12) for agent in range(4)]
        with serve(tiny_model_dirs[arch], "--batch", "4", "--shared-prefix-attention", "on", *flags) as server:
            ask(server.url, system, 99, 2)  # the system prompt is in the prompt cache before the wave
            got = wave(server.url, system, range(4), 12)
            steps = shared_steps(server.url)
        assert got == want, (arch, flags)
        assert steps > 0, (arch, flags)
