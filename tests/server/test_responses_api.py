"""OpenAI Responses against a real server, through the official ``openai`` SDK."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import TypeAdapter

from mlxq.engine.types import FinishReason, TokenEvent, Usage
from mlxq.server.accumulator import Accumulator
from mlxq.server.protocol import TokenLimits
from mlxq.server.responses_format import ResponseRenderer
from mlxq.server.responses_request import ResponsesRequest, parse_responses

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
# Bounded strings and numbers: a random model under a grammar cannot wander past max_output_tokens.
TRIP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "nights": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "nights"], "additionalProperties": False}
BOOK = {"type": "function", "name": "book", "parameters": TRIP, "strict": True}


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=llama_server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="x", messages=messages, temperature=0, **kw)


def test_plain_response_matches_chat_completions(client):
    got = client.responses.create(model="gpt-x", input="Hello there", instructions="Be brief.",
                                  max_output_tokens=10, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                 max_tokens=10)
    assert got.object == "response" and got.model == "gpt-x" and got.id.startswith("resp_")
    assert got.output_text == chat.choices[0].message.content
    assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if got.status == "incomplete":
        assert got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens
    assert got.store is False


def test_stream_matches_the_plain_response(client):
    kwargs = {"model": "x", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}],
              "max_output_tokens": 8, "temperature": 0}
    plain = client.responses.create(**kwargs)
    # (The SDK's responses.stream() helper insists on response.completed; an incomplete
    # response ends with response.incomplete, as OpenAI's does, so read the raw events.)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    final = events[-1].response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if plain.status == "incomplete" else "response.completed")
    if plain.output_text:
        assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_sequence_numbers_count_up(llama_server):
    body = {"model": "x", "input": "hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", llama_server.url + "/v1/responses", json=body) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    # OpenAI's spec allows no null usage: absent while in progress, present at the end.
    assert "usage" not in data[0]["response"] and data[-1]["response"]["usage"]["output_tokens"] >= 1


def test_tool_items_render_like_chat_tool_messages(client):
    """Codex's later turns: its function_call and the call's output come back as input items;
    namespaced (MCP) tools appear to the model as namespace__name."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False},
             {"type": "namespace", "name": "mcp__files", "description": "Files",
              "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]},
             {"type": "web_search"}]
    items = [{"type": "message", "role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "call_2", "name": "read", "namespace": "mcp__files",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]}]
    got = client.responses.create(model="x", input=items, tools=tools, max_output_tokens=3, temperature=0,
                                  parallel_tool_calls=True, tool_choice="auto", store=False)
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": WEATHER}},
                  {"type": "function", "function": {"name": "mcp__files__read", "description": "",
                                                    "parameters": {"type": "object"}}}]
    chat = _chat(client, [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "mcp__files__read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"}], tools=chat_tools, max_tokens=3)
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.output_text == chat.choices[0].message.content
    assert got.parallel_tool_calls is True and [t.type for t in got.tools] == ["function", "namespace", "web_search"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_arguments_validate(client, stream):
    kwargs = {"model": "x", "input": "Trip?", "tools": [BOOK, {"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "name": "book", "parameters": {"type": "object"}}]}],
              "tool_choice": {"type": "function", "name": "book"}, "max_output_tokens": 200, "temperature": 0.7}
    if stream:
        final = list(client.responses.create(stream=True, **kwargs))[-1].response
    else:
        final = client.responses.create(**kwargs)
    assert final.status == "completed"
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.name == "book" and call.namespace is None
    jsonschema.validate(json.loads(call.arguments), TRIP)


def test_text_format_json_schema_is_enforced(client):
    got = client.responses.create(model="x", input="Trip?", max_output_tokens=200,
                                  text={"format": {"type": "json_schema", "name": "trip", "schema": TRIP}})
    jsonschema.validate(json.loads(got.output_text), TRIP)
    assert got.text.format.type == "json_schema"


def test_stateful_and_unsupported_requests_are_clear_400s(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="x", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(model="x", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    with pytest.raises(openai.BadRequestError, match="not among"):
        client.responses.create(model="x", input="hi", tools=[BOOK], tool_choice={"type": "function", "name": "no"})


def test_model_by_id(client, llama_server):
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def _render(load_tiny, tools: list, pieces: list[str], finish: FinishReason):
    """A generation the tiny llama's tool parser reads, through the Responses renderer."""
    lm = type("LM", (), {})()
    _, lm.tokenizer = load_tiny("llama")
    lm.vocab_size, lm.context_length = 512, 4096
    request: ResponsesRequest = parse_responses({"model": "m", "input": "hi", "tools": tools}, lm, TokenLimits())
    acc = Accumulator(lm.tokenizer, request.spec.tools)
    renderer = ResponseRenderer(acc, request, "m")
    usage = Usage(prompt_tokens=9, completion_tokens=len(pieces), cached_tokens=4, queue_s=0, ttft_s=0, decode_s=0)
    sse = renderer.start()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        sse += renderer.step(acc.add(TokenEvent("r", piece, finish_reason=finish if last else None,
                                                usage=usage if last else None)))
    return [json.loads(chunk.split("\ndata: ", 1)[1]) for chunk in sse.strip().split("\n\n")]


def test_streamed_calls_validate_against_the_sdk_types(load_tiny):
    """Every event validates as the SDK's ResponseStreamEvent; namespaced and custom tools come back
    under their own names, and the completed response holds the same items."""
    from openai.types.responses import ResponseStreamEvent

    tools = [{"type": "namespace", "name": "mcp__files", "description": "Files",
              "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]},
             {"type": "custom", "name": "apply_patch", "description": "Edit files"}]
    pieces = ["Reading. <tool_call>", '{"name": "mcp__files__read", "arguments": {"path": "a"}}</tool_call>',
              '<tool_call>{"name": "apply_patch", "arguments": {"input": "*** Begin"}}</tool_call>']
    events = _render(load_tiny, tools, pieces, FinishReason.STOP)
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    assert parsed[-1].type == "response.completed"
    output = parsed[-1].response.output
    assert [o.type for o in output] == ["message", "function_call", "custom_tool_call"]
    assert output[0].content[0].text == "Reading. "
    assert (output[1].name, output[1].namespace, json.loads(output[1].arguments)) == ("read", "mcp__files",
                                                                                     {"path": "a"})
    assert (output[2].name, output[2].input) == ("apply_patch", "*** Begin")
    assert parsed[-1].response.usage.input_tokens_details.cached_tokens == 4
    deltas = [e.delta for e in parsed if e.type == "response.function_call_arguments.delta"]
    assert deltas == [output[1].arguments]
