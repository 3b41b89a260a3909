"""Generated request bodies against a real server: never a 5xx, never a hang, healthy after.

Bodies mix every field the server reads with values of every JSON type
(and a few field names it does not know), at both generation endpoints.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerProcess

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty", "frequency_penalty",
          "logit_bias", "logprobs", "top_logprobs", "seed", "stop", "stream", "stream_options", "n",
          "response_format", "tools", "tool_choice", "chat_template_kwargs", "ignore_eos", "deterministic",
          "xtc_probability", "xtc_threshold", "adapters", "draft_model", "num_draft_tokens", "user", "zzz"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=10)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.one_of(st.text(max_size=30), json_values)}),
                    max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda d: st.fixed_dictionaries({"messages": messages}).map(lambda m: {**d, **m}) if "messages" not in d
    else st.just(d))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--max-tokens-limit", "4",
                       "--log-level", "warning") as server:
        yield server


def _never_5xx(server: ServerProcess, body, path: str) -> None:
    try:
        r = httpx.post(server.url + path, json=body, timeout=30)
    except ValueError:  # httpx cannot encode NaN/inf or lone surrogates; raw NaN is in test_bad_input
        return
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"]


PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=PATHS)
def test_generated_bodies_never_5xx(fuzz_server, body, path):
    _never_5xx(fuzz_server, body, path)


@pytest.mark.slow  # 2,000 bodies: about 160 s on two cores
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=PATHS)
def test_many_generated_bodies_never_5xx(fuzz_server, body, path):
    _never_5xx(fuzz_server, body, path)


def test_server_is_healthy_after_the_fuzz(fuzz_server):
    assert httpx.get(fuzz_server.url + "/health").json()["status"] == "ok"


def _hostile_value(kind: str, size: int) -> str:
    """JSON text of a value shaped to break parsers and tokenizers (each once a 500)."""
    if kind == "deep":
        return "[" * size + "]" * size
    if kind == "digits":
        return "9" * size
    if kind == "surrogate":
        return '"a\\ud%03xb"' % (0x800 + size % 0x800)  # lone high or low surrogate escape
    return '{"x": ' * size + "1" + "}" * size  # deep objects


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), kind=st.sampled_from(["deep", "digits", "surrogate", "deep_objects"]),
       size=st.integers(1, 6000), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_hostile_raw_values_never_5xx(fuzz_server, field, kind, size, path):
    base = '"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"'
    raw = "{" + base + f', "{field}": {_hostile_value(kind, size)}' + "}"
    r = httpx.post(fuzz_server.url + path, content=raw.encode(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code < 500, (field, kind, size, r.text)
