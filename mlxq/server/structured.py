"""Structured outputs: ``response_format`` and forced tool calls as llguidance grammars.

- ``{"type": "json_object"}``: any JSON object.
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: JSON
  matching ``schema`` (enforced whatever ``strict`` says).
- A forced tool call (``tool_choice`` naming a function, or ``"required"``):
  the whole call text, start marker + ``{"name": ..., "arguments": ...}`` +
  end marker, in the model's own tool-call format, with ``arguments``
  matching the function's ``parameters`` schema; then EOS.

Grammars are validated against the model's tokenizer here, so a schema the
library cannot enforce is a 400 naming the construct, before the request
reaches the engine. ``forced_tool_grammar`` is protocol-neutral (Anthropic
``tool_choice`` and Responses forced functions use it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxq.engine.grammar import llg_tokenizer
from mlxq.engine.types import GrammarSpec
from mlxq.server.errors import invalid
from mlxq.server.offload import INLINE_TEXT_CHARS, leave_loop_if

# Tool-call formats whose payload is {"name": ..., "arguments": {...}} JSON between two markers.
JSON_PAYLOAD_PARSERS = frozenset({"mlx_lm.tool_parsers.json_tools"})
# Compact JSON: a random or weak model cannot wander off into endless whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class FunctionTool:
    """A tool the model may be forced to call, whatever protocol named it."""

    name: str
    parameters: dict | None  # JSON Schema of the arguments; None allows any object


def response_format_grammar(response_format, lm) -> GrammarSpec | None:
    """OpenAI's ``response_format`` -> a grammar (None for text). ``lm`` is the loaded model."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise invalid("'response_format' must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar("json_object", {"type": "object"}, lm, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid("'response_format.json_schema' must be an object with a 'name'",
                          "response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise invalid("'response_format.json_schema.schema' must be a JSON Schema object",
                          "response_format.json_schema.schema")
        return _json_grammar("json_schema", schema, lm, "response_format.json_schema.schema")
    raise invalid(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                  "response_format.type")


def forced_tool_grammar(tools: list[FunctionTool], name: str | None, lm, param: str = "tool_choice") -> GrammarSpec:
    """The grammar of one call to the tool ``name`` (or to any of ``tools`` when None)."""
    tokenizer = lm.tokenizer
    parser = getattr(tokenizer.tool_parser, "__module__", None)
    if not tokenizer.has_tool_calling or parser not in JSON_PAYLOAD_PARSERS:
        raise invalid(f"this model's tool-call format ({parser or 'none'}) cannot be forced: "
                      "use tool_choice 'auto' or 'none'", param, "unsupported")
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools", param)
    calls = [_call_schema(t) for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    start, end = (_marker(m, tokenizer, lm.vocab_size) for m in (tokenizer.tool_call_start, tokenizer.tool_call_end))
    lark = f"start: {start} call {end}\ncall: %json{json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}\n"
    import llguidance

    return _validated(GrammarSpec("tool_call", llguidance.LLMatcher.grammar_from_lark(lark)), lm, param)


def openai_tools(tools: list[dict]) -> list[FunctionTool]:
    """Chat Completions ``tools`` (already validated by protocol.py) -> FunctionTools."""
    return [FunctionTool(t["function"]["name"], t["function"].get("parameters")) for t in tools]


def chat_grammar(body: dict, tools: list[dict] | None, lm) -> GrammarSpec | None:
    """The grammar a Chat Completions body asks for: a forced tool call first, else ``response_format``."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return response_format_grammar(body.get("response_format"), lm)
    if not tools:
        raise invalid("'tool_choice' forces a tool call but no 'tools' were given", "tool_choice")
    if choice == "required":
        return forced_tool_grammar(openai_tools(tools), None, lm)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return forced_tool_grammar(openai_tools(tools), function["name"], lm)


def _call_schema(tool: FunctionTool) -> dict:
    parameters = tool.parameters if tool.parameters is not None else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _marker(text: str, tokenizer, vocab_size: int) -> str:
    """A tool-call marker in Lark: its special token when it is one (text cannot spell those), else the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and llg_tokenizer(tokenizer, vocab_size).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _json_grammar(kind: str, schema: dict, lm, param: str) -> GrammarSpec:
    import llguidance

    schema_text = json.dumps(schema)
    leave_loop_if(len(schema_text) >= INLINE_TEXT_CHARS)  # a large schema compiles in a worker thread
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    except (TypeError, ValueError) as exc:
        raise invalid(f"the JSON schema cannot be used: {exc}", param) from None
    return _validated(GrammarSpec(kind, text), lm, param)


def _validated(spec: GrammarSpec, lm, param: str) -> GrammarSpec:
    """A 400 naming what the grammar library refuses (an unknown keyword, a look-around regex...)."""
    import llguidance

    leave_loop_if(len(spec.grammar) >= INLINE_TEXT_CHARS)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        spec.grammar, llg_tokenizer(lm.tokenizer, lm.vocab_size))
    if failed:
        raise invalid(f"the schema cannot be enforced: {'; '.join(messages)}", param, "unsupported_schema")
    return spec
