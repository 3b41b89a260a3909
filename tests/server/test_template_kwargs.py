"""chat_template_kwargs carry plain template variables only; the model's template renders within a budget."""

from __future__ import annotations

import httpx
import pytest

from mlxq.server import prompts
from mlxq.server.errors import APIError

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("kwargs", [
    {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
    {"tokenize": False}, {"return_tensors": "np"}, {"return_dict": True}, {"padding": True}, {"truncation": True},
    {"max_length": 3}, {"add_generation_prompt": False}, {"continue_final_message": True}, {"tools": None},
    {"messages": "x"}, {"documents": None}, {"tokenizer_kwargs": None},
    {"enable_thinking": {"nested": 1}}, {"enable_thinking": [1]}, {"x": "y" * 5000}, {"x": 2**64},
    {"": 1}, {"has space": 1}, {"_private": 1}, {f"k{i}": 1 for i in range(33)},
])
def test_unsafe_template_kwargs_are_a_400(llama_server, kwargs):
    r = httpx.post(llama_server.url + CHAT, json={"messages": MSG, "max_tokens": 1, "chat_template_kwargs": kwargs},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and error["type"] == "invalid_request_error"


def test_plain_template_variables_are_accepted(llama_server):
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "budget": 3, "temperature_hint": 0.5,
              "nothing": None}
    r = httpx.post(llama_server.url + CHAT, json={"messages": MSG, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text


def test_chat_tokens_equal_mlx_lm_apply_chat_template(load_tiny):
    """Rendering to text and encoding it is what apply_chat_template(tokenize=True) does."""
    _, tokenizer = load_tiny("llama")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo <s> wörld"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert prompts.tokenize_chat(tokenizer, messages, None, {}) == list(expected)


class _SlowTemplate:
    """A tokenizer whose template render outlives the budget (a pathological template)."""

    def apply_chat_template(self, *args, **kwargs):
        import time

        time.sleep(1.0)
        return "late"


def test_a_render_over_the_time_budget_is_a_400(monkeypatch):
    monkeypatch.setattr(prompts, "RENDER_TIMEOUT_S", 0.2)
    with pytest.raises(APIError) as err:
        prompts.render_chat(_SlowTemplate(), MSG, None, {}, add_generation_prompt=True)
    assert err.value.status == 400 and err.value.code == "template_timeout"


def test_a_render_over_the_size_budget_is_a_400(monkeypatch, load_tiny):
    _, tokenizer = load_tiny("llama")
    monkeypatch.setattr(prompts, "MAX_RENDERED_CHARS", 100)
    with pytest.raises(APIError) as err:
        prompts.render_chat(tokenizer, [{"role": "user", "content": "x" * 200}], None, {}, add_generation_prompt=True)
    assert err.value.code == "template_too_large"
