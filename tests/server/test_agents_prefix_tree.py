"""32 agents sharing a long system prompt on a real server whose RAM tier holds 6 full agent copies.

The prefix tree stores the shared prompt once, so every agent's own state
fits: a second wave of the same 32 prompts is served from RAM (all but the
last prompt token) and gives the same greedy output as the first.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from mlxq.golden.cases import LONG
from mlxq.kv.projection import measure_footprint
from tests.conftest import ServerProcess

AGENTS = 32
MAX_TOKENS = 12


def system_prompt(tokenizer, target: int = 900) -> str:
    words, text = LONG.split(), ""
    i = 0
    while len(tokenizer.encode(text)) < target:
        text += words[i % len(words)] + " "
        i += 1
    return text.strip()


def messages(system: str, agent: int) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Agent {agent}: what is step {agent * 7} of the plan?"}]


def ask(url: str, system: str, agent: int) -> dict:
    body = {"messages": messages(system, agent), "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def wave(url: str, system: str) -> list[dict]:
    with ThreadPoolExecutor(AGENTS) as pool:
        return list(pool.map(lambda agent: ask(url, system, agent), range(AGENTS)))


def test_a_second_wave_of_32_agents_is_served_from_ram_with_the_same_output(tiny_model_dirs, load_tiny):
    model, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer)
    per_token = sum(layer.bytes_per_token for layer in measure_footprint(model).layers)
    prompt_tokens = len(tokenizer.apply_chat_template(messages(system, 0), add_generation_prompt=True))
    agent_tokens = prompt_tokens + MAX_TOKENS  # what one agent's full copy holds at the end
    cap = 6 * agent_tokens * per_token
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--batch", "16", "--log-level", "warning",
                       "--prompt-cache", str(cap)) as server:
        first = wave(server.url, system)
        second = wave(server.url, system)
        stats = httpx.get(server.url + "/stats").json()["prompt_cache"]
    assert first[0]["usage"]["prompt_tokens"] == prompt_tokens and prompt_tokens >= 900
    for a, b in zip(first, second, strict=True):
        usage = b["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1, usage
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    assert stats["entries"] >= AGENTS and stats["bytes"] <= cap < stats["entry_bytes"]


def test_after_a_restart_the_shared_prompt_is_read_from_ssd_once(tiny_model_dirs, load_tiny, tmp_path):
    """The SSD tier holds the tree too: the 32 agents' files restore after a restart, no file read twice."""
    import signal

    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer)
    args = ("--model", str(tiny_model_dirs["llama"]), "--batch", "16", "--log-level", "warning",
            "--ssd-cache", str(tmp_path))
    with ServerProcess(*args) as server:
        first = wave(server.url, system)
        assert httpx.post(server.url + "/admin/cache/flush", timeout=120).json()["durable"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    with ServerProcess(*args) as server:
        second = wave(server.url, system)
        ssd = httpx.get(server.url + "/stats").json()["ssd_cache"]
    for a, b in zip(first, second, strict=True):
        usage = b["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1, usage
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    sizes = sorted(f.stat().st_size for f in tmp_path.rglob("*.mlxkv"))
    assert sizes[-1] > 4 * sizes[-2]  # one file holds the system prompt; the agents' own files are small
    assert ssd["restores"] == AGENTS and ssd["read_bytes"] >= sizes[-1]
    assert ssd["reread_bytes"] < sizes[-1], ssd  # the system prompt's file was read once
