"""`mlxq serve --temp/--top-p/--top-k/--min-p/--max-tokens`: what a request leaves out, in every protocol.

mlx-lm is the oracle: a request without sampling fields on a `--temp 0.8 --top-k 20` server samples
exactly as mlx-lm does with those settings; a request's own value (temperature 0) wins.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app
from mlxq.golden.cases import CASES
from mlxq.golden.oracle import oracle_tokens
from tests.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def sampling_server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-level", "warning", "--temp", "0.8",
                       "--top-k", "20", "--top-p", "0.9", "--max-tokens", "7") as server:
        yield server


@pytest.fixture(scope="module")
def greedy_server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-level", "warning", "--temp", "0",
                       "--max-tokens", "6") as server:
        yield server


def _oracle(load_tiny, prompt_ids: list[int], max_tokens: int, **sampling) -> str:
    model, tokenizer = load_tiny("llama")
    case = replace(CASES[0], max_tokens=max_tokens, sampling=sampling)
    return tokenizer.decode(oracle_tokens(model, tokenizer, prompt_ids, case))


def test_server_sampling_defaults_match_mlx_lm_and_a_requests_own_value_wins(sampling_server, load_tiny):
    _, tokenizer = load_tiny("llama")
    prompt_ids = tokenizer.encode(CASES[0].prompt)
    url = sampling_server.url + "/v1/completions"
    sampled = httpx.post(url, json={"prompt": prompt_ids, "seed": 11}).json()
    assert sampled["usage"]["completion_tokens"] == 7  # --max-tokens
    assert sampled["choices"][0]["text"] == _oracle(load_tiny, prompt_ids, 7, temperature=0.8, top_k=20,
                                                    top_p=0.9, seed=11)
    greedy = httpx.post(url, json={"prompt": prompt_ids, "temperature": 0, "max_tokens": 9}).json()
    assert greedy["usage"]["completion_tokens"] == 9
    assert greedy["choices"][0]["text"] == _oracle(load_tiny, prompt_ids, 9)
    assert greedy["choices"][0]["text"][:len(sampled["choices"][0]["text"])] != sampled["choices"][0]["text"]


def test_chat_without_temperature_samples_at_the_servers_temp(sampling_server, load_tiny):
    _, tokenizer = load_tiny("llama")
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    body = httpx.post(sampling_server.url + "/v1/chat/completions", json={"messages": MESSAGES, "seed": 3}).json()
    assert body["choices"][0]["message"]["content"] == _oracle(load_tiny, prompt_ids, 7, temperature=0.8, top_k=20,
                                                               top_p=0.9, seed=3)


def test_responses_and_messages_take_the_servers_temp_instead_of_their_own_default(greedy_server, load_tiny):
    # Both protocols default to temperature 1; a `--temp 0` server makes them greedy when they set none.
    _, tokenizer = load_tiny("llama")
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    greedy = _oracle(load_tiny, prompt_ids, 6)
    response = httpx.post(greedy_server.url + "/v1/responses", json={"input": MESSAGES}).json()
    assert response["output"][0]["content"][0]["text"] == greedy
    assert response["temperature"] == 0 and response["usage"]["output_tokens"] == 6
    message = httpx.post(greedy_server.url + "/v1/messages", json={"messages": MESSAGES, "max_tokens": 6}).json()
    assert message["content"][0]["text"] == greedy
    chat = httpx.post(greedy_server.url + "/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert chat["choices"][0]["message"]["content"] == greedy and chat["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("flag, value, message", [
    ("--temp", "-1", "--temp must be 0-100"),
    ("--top-p", "1.5", "--top-p must be 0-1"),
    ("--max-tokens", "0", "--max-tokens must be >= 1"),
])
def test_out_of_range_defaults_are_one_line_naming_the_flag(flag, value, message):
    result = CliRunner().invoke(app, ["serve", flag, value])
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
