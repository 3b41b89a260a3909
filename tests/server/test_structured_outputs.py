"""response_format and forced tool calls against a real server, with the openai SDK, on a random-weight model.

Random weights write gibberish; the grammar is what makes the output JSON that
matches the schema, so every assertion here fails without it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import ServerProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
        "nickname": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/short"}]},
    },
    "required": ["name", "age", "role", "tags", "address", "nickname"],
    "additionalProperties": False,
    "$defs": {"short": {"type": "string", "maxLength": 5}},
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}},
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSG = [{"role": "user", "content": "Tell me about someone."}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--batch", "8", "--log-level", "warning") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_eight_concurrent_json_schema_requests_all_validate(client, server):
    def ask(i: int):
        return client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": f"Person number {i}"}], temperature=0.8, seed=i,
            max_tokens=300, response_format=person_format())

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    texts = set()
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 1  # sampled, not one forced string
    assert httpx.get(f"{server.url}/stats").json()["grammar"]["masks"] > 0


def test_json_object_is_an_object(client, tiny_model_dirs):
    # Random weights would write one endless string: a bias towards quotes and braces lets the object close
    # (alone, the bias writes '"}"}"}...': the grammar is what makes it an object).
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_dirs["llama"] / "tokenizer.json"))
    bias = {str(tokenizer.token_to_id(t)): 60 for t in ('"', "}")}
    answer = client.chat.completions.create(model="x", messages=MSG, max_tokens=200, logit_bias=bias,
                                            response_format={"type": "json_object"})
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_json_schema_streams(client):
    stream = client.chat.completions.create(model="x", messages=MSG, max_tokens=300, stream=True,
                                            response_format=person_format())
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("choice,name", [
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
    ("required", None),
])
def test_forced_tool_call_arguments_validate(client, choice, name):
    answer = client.chat.completions.create(model="x", messages=MSG, tools=[WEATHER, CLOCK], tool_choice=choice,
                                            max_tokens=200, temperature=0.7, seed=3)
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[calls[0].function.name]
    assert name in (None, calls[0].function.name)
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    legs: int = pydantic.Field(ge=0, le=8)
    kind: str = pydantic.Field(pattern="^(cat|dog|bird)$")


def test_sdk_parse_with_a_pydantic_model(client):
    answer = client.chat.completions.parse(model="x", messages=MSG, max_tokens=200, response_format=Pet)
    pet = answer.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "bird")


def test_greedy_structured_output_is_the_same_on_both_lanes(client):
    body = {"model": "x", "messages": MSG, "max_tokens": 300, "response_format": person_format()}
    batched = client.chat.completions.create(**body).choices[0].message.content
    serial = client.chat.completions.create(**body, extra_body={"deterministic": True}).choices[0].message.content
    assert batched == serial
    jsonschema.validate(json.loads(serial), PERSON)


@pytest.mark.parametrize("extra,words,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name",
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, "look-around", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "unevaluatedProperties": False}}}}, "unevaluatedProperties",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among",
     "tool_choice"),
    ({"tool_choice": "required"}, "no 'tools'", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 5}, "tool_choice", "tool_choice"),
])
def test_structured_requests_it_cannot_honour_are_400(server, extra, words, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words.lower() in error["message"].lower(), error
    assert error["param"] == param
