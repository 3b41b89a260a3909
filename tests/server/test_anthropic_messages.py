"""Anthropic Messages against a real server, through the official ``anthropic`` SDK.

The SDK no longer offers temperature/top_p/top_k; older clients still send them, and mlxq
reads them, so greedy runs pass ``temperature: 0`` in the body (GREEDY).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mlxq.engine.types import FinishReason, TokenEvent, Usage
from mlxq.server.accumulator import Accumulator
from mlxq.server.anthropic_format import MessageStream, message_json
from tests.conftest import ServerProcess

KEY = "sk-test"
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
GREEDY = {"extra_body": {"temperature": 0}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                   "parameters": TOOLS[0]["input_schema"]}}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--api-key", KEY, "--log-level", "warning") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _chat_text(oai, messages, **kw) -> str:
    return oai.chat.completions.create(model="x", messages=messages, temperature=0, **kw).choices[0].message.content


def test_plain_message_matches_chat_completions(client, oai):
    """The same conversation through either protocol is the same prompt, so greedy text is the same."""
    msg = client.messages.create(model="claude-x", max_tokens=12, **GREEDY, system="Be brief.",
                                 messages=[{"role": "user", "content": "Hello there"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-x"
    assert msg.id.startswith("msg_")
    expected = _chat_text(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                          max_tokens=12)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == expected
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens <= 12
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


def test_system_blocks_and_content_blocks_render_like_strings(client):
    as_strings = client.messages.count_tokens(model="x", system="Be brief.",
                                              messages=[{"role": "user", "content": "Hi you"}])
    as_blocks = client.messages.count_tokens(
        model="x", system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}])
    assert as_strings.input_tokens == as_blocks.input_tokens > 0


def test_system_messages_between_turns_are_accepted(client, oai):
    """Claude Code sends reminders as role "system" messages among the turns."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Agents: none."},
             {"role": "user", "content": "Go"}]
    counted = client.messages.count_tokens(model="x", messages=turns)
    chat = oai.chat.completions.create(model="x", messages=turns, max_tokens=1)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_stream_event_sequence_and_text(client):
    kwargs = {"model": "x", "max_tokens": 10, **GREEDY, "messages": [{"role": "user", "content": "Count"}]}
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_stop_sequence_is_reported(client):
    kwargs = {"model": "x", **GREEDY, "messages": [{"role": "user", "content": "Say things"}]}
    plain = client.messages.create(max_tokens=16, stop_sequences=["\x00never"], **kwargs)
    assert plain.stop_sequence is None  # configured, but not what ended it
    full = plain.content[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = client.messages.create(max_tokens=16, stop_sequences=[stop, "\x00never"], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == full[: full.index(stop)]


def test_tool_use_round_trip_renders_through_the_template(client, oai):
    """Claude Code's second turn: the assistant's tool_use, then the user's tool_result."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]},
    ]
    msg = client.messages.create(model="x", max_tokens=4, **GREEDY, tools=TOOLS,
                                 tool_choice={"type": "auto"}, messages=messages)
    chat = oai.chat.completions.create(model="x", max_tokens=4, temperature=0, tools=OPENAI_TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == chat.choices[0].message.content
    without_tools = client.messages.count_tokens(model="x", messages=messages[:1])
    with_tools = client.messages.count_tokens(model="x", messages=messages[:1], tools=TOOLS)
    assert with_tools.input_tokens > without_tools.input_tokens
    none = client.messages.count_tokens(model="x", messages=messages[:1], tools=TOOLS, tool_choice={"type": "none"})
    assert none.input_tokens == without_tools.input_tokens


# Bounded strings and numbers: a random model under a grammar cannot wander past max_tokens.
BOUNDED = {"name": "book", "description": "Book a trip", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "nights": {"type": "integer",
                                     "minimum": 1, "maximum": 9}, "class": {"enum": ["eco", "biz"]}},
    "required": ["city", "nights", "class"], "additionalProperties": False}}


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "book"}, {"type": "any"}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_input_matches_its_schema(client, choice, stream):
    """tool_choice tool/any is enforced by a grammar: random weights still call the tool, with valid input."""
    kwargs = {"model": "x", "max_tokens": 200, "tools": [BOUNDED], "tool_choice": choice,
              "messages": [{"role": "user", "content": "Trip?"}], "extra_body": {"temperature": 0.7}}
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    [call] = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "book" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, BOUNDED["input_schema"])


def test_output_config_format_is_enforced(client):
    schema = BOUNDED["input_schema"]
    msg = client.messages.create(model="x", max_tokens=200, messages=[{"role": "user", "content": "Trip?"}],
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_beta_route_and_ignored_fields(client):
    msg = client.beta.messages.create(
        model="x", max_tokens=3, messages=[{"role": "user", "content": "hi"}], metadata={"user_id": "u1"},
        thinking={"type": "enabled", "budget_tokens": 1024}, output_config={"effort": "low"},
        cache_control={"type": "ephemeral"}, context_management={"edits": []},
        tools=[*TOOLS, {"type": "web_search_20250305", "name": "web_search"}],
        extra_body={"top_k": 5, "top_p": 0.9, "temperature": 0.7})
    assert msg.type == "message"


def test_raw_stream_frames_events_by_name(server):
    body = {"model": "x", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers={"x-api-key": KEY}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_max_tokens_beyond_the_context_is_clamped(client):
    """Claude Code always asks for 64000 (streamed): it gets what fits in the context."""
    def tokens(n: int) -> int:
        return client.messages.count_tokens(model="x", messages=[{"role": "user", "content": "hi " * n}]).input_tokens

    per_word = (tokens(200) - tokens(100)) / 100
    words = int((4096 - 8 - tokens(0)) / per_word)  # the tiny llama's context is 4096: ~8 tokens of room
    room = 4096 - tokens(words)
    with client.messages.stream(model="x", max_tokens=64000, messages=[{"role": "user", "content": "hi " * words}],
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert 0 < room <= 16 and final.usage.output_tokens <= room
    assert final.stop_reason == "max_tokens" or final.usage.output_tokens < room


def test_errors_come_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="x", max_tokens=5, messages=[{"role": "wizard", "content": "hi"}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "role" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="x", max_tokens=5,
                               messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    with pytest.raises(anthropic.BadRequestError, match="not among"):
        client.messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    missing = httpx.post(server.url + "/v1/messages", json={"model": "x", "messages": []}, headers={"x-api-key": KEY})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert auth.value.body["error"]["type"] == "authentication_error"


def test_openai_routes_take_either_key_header(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = server.url + "/v1/chat/completions"
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    refused = httpx.post(url, json=body, headers={"x-api-key": "nope"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def _events(load_tiny, text_pieces: list[str], finish: FinishReason):
    """A generation the tiny llama's tool parser reads, through the Messages stream renderer."""
    _, tokenizer = load_tiny("llama")
    acc = Accumulator(tokenizer, OPENAI_TOOLS)
    stream = MessageStream(acc, "msg_1", "m", prompt_tokens=7)
    usage = Usage(prompt_tokens=7, completion_tokens=len(text_pieces), cached_tokens=3, queue_s=0, ttft_s=0,
                  decode_s=0)
    sse = stream.start()
    for i, piece in enumerate(text_pieces):
        last = i == len(text_pieces) - 1
        sse += stream.step(acc.add(TokenEvent("r", piece, finish_reason=finish if last else None,
                                              usage=usage if last else None)))
    return acc, sse


def test_streamed_tool_use_parses_in_the_sdk(load_tiny):
    """A tool call in the output becomes a tool_use block whose input the SDK's own stream
    accumulator rebuilds from input_json_delta, equal to the non-streamed message."""
    from anthropic.lib.streaming._messages import accumulate_event

    pieces = ["Let me look. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "</tool_call>"]
    acc, sse = _events(load_tiny, pieces, FinishReason.STOP)
    snapshot, bufs = None, {}
    for chunk in sse.strip().split("\n\n"):
        data = json.loads(chunk.split("\ndata: ", 1)[1])
        if data["type"] != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    final = message_json(acc, "msg_1", "m", 7)
    assert snapshot.stop_reason == final["stop_reason"] == "tool_use"
    assert [b.type for b in snapshot.content] == ["text", "tool_use"]
    assert snapshot.content[0].text == "Let me look. "
    assert snapshot.content[1].name == "get_weather" and snapshot.content[1].input == {"city": "Paris"}
    assert snapshot.model_dump(exclude_none=True)["content"] == final["content"]
    assert final["usage"] == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3,
                              "output_tokens": 5}
