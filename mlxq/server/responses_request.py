"""OpenAI Responses requests, read into the chat form the chat template and the engine take.

Stateless (``store: false`` semantics): the whole conversation comes in ``input``;
``previous_response_id`` and ``conversation`` are refused. ``instructions`` and
leading system/developer items become one system message. Function tools, tools
grouped in a ``namespace`` (as Codex sends MCP tools; the model sees
``namespace__name``) and ``custom`` (freeform) tools, whose one string input the
model writes as ``{"input": ...}``, are offered through the chat template; hosted
tools (web search, file search...) do not exist here and are left out. A forced
tool_choice and ``text.format`` are enforced by a grammar (structured.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from mlxq.server.errors import invalid
from mlxq.server.protocol import GenerationSpec, TokenLimits, parse_generation
from mlxq.server.request_defaults import PROTOCOL_DEFAULTS, RequestDefaults
from mlxq.server.validate import read_int

RESPONSES_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
NAMESPACE_JOIN = "__"
_TEXT_PARTS = ("input_text", "output_text", "text")
_SKIPPED_ITEMS = ("reasoning",)  # earlier turns' reasoning: the model here does not read it back
_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass(frozen=True)
class ToolName:
    """How a tool the model may call is named on the wire."""

    name: str
    namespace: str | None = None
    custom: bool = False  # a freeform tool: its call is a custom_tool_call with a string input


@dataclass(frozen=True)
class ResponsesRequest:
    spec: GenerationSpec
    tool_names: dict[str, ToolName]  # the name the model writes -> the tool's wire name
    echo: dict  # request fields the Response object repeats (tools, tool_choice, ...)


def parse_responses(body, lm, limits: TokenLimits, defaults: RequestDefaults = PROTOCOL_DEFAULTS) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _refuse_stateful(body)
    functions, names = _tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    chat = {
        "model": body.get("model"),
        "messages": _messages(body.get("instructions"), body.get("input"), names),
        "max_tokens": read_int(body, "max_output_tokens", None, lo=1),
        "temperature": body.get("temperature", defaults.get("temperature", RESPONSES_DEFAULT_TEMPERATURE)),
        "top_p": body.get("top_p"),
        "stream": body.get("stream"),
    }
    if functions and choice != "none":
        chat["tools"] = functions
        chat["tool_choice"] = _chat_tool_choice(choice, names)
    chat["response_format"] = _response_format(body.get("text"))
    spec = parse_generation(chat, "chat", lm, limits, defaults)
    if chat["max_tokens"] is None and lm.context_length is not None:
        # Responses has no default cap: as much as the context holds (and the server allows).
        room = lm.context_length - len(spec.prompt_ids)
        spec = replace(spec, max_tokens=min(x for x in (room, limits.cap, defaults.max_tokens) if x is not None))
    echo = {"tools": body.get("tools") or [], "tool_choice": choice,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": chat["temperature"], "top_p": body.get("top_p", defaults.get("top_p", 1.0)),
            "max_output_tokens": chat["max_tokens"], "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}}}
    return ResponsesRequest(spec, names, echo)


def _refuse_stateful(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise invalid("'previous_response_id' is not supported: this server keeps no responses (store: false); "
                      "send the whole conversation in 'input'", "previous_response_id", "unsupported")
    if body.get("conversation") is not None:
        raise invalid("'conversation' is not supported: this server keeps no state; send the whole "
                      "conversation in 'input'", "conversation", "unsupported")
    if body.get("background"):
        raise invalid("'background' responses are not supported", "background", "unsupported")


def _chat_tool_choice(choice, names: dict[str, ToolName]):
    """Responses' tool_choice in chat's words: "required", or a named function (by the name the model
    writes: namespace__name), forced by a grammar; anything else (auto, allowed_tools...) is "auto"."""
    if choice == "required":
        return "required"
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        wanted = choice.get("name")
        flat = next((flat for flat, tool in names.items()
                     if tool.name == wanted and tool.namespace == choice.get("namespace")), wanted)
        return {"type": "function", "function": {"name": flat}}
    return "auto"


def _response_format(text) -> dict | None:
    """``text.format`` in chat's words: json_schema's fields sit one level up in Responses."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt.get("schema", {})}}
    return fmt  # json_object, or a type structured.py refuses by name


def _tools(tools) -> tuple[list[dict], dict[str, ToolName]]:
    if tools is None:
        return [], {}
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise invalid("'tools' must be a list of objects", "tools")
    functions: list[dict] = []
    names: dict[str, ToolName] = {}
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "namespace":
            members = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(members, list):
                raise invalid(f"tools[{i}]: a namespace needs a 'name' and a list of 'tools'", "tools")
            for member in members:
                _add_tool(f"tools[{i}].tools", member, tool["name"], functions, names)
        elif kind in ("function", "custom"):
            _add_tool(f"tools[{i}]", tool, None, functions, names)
    return functions, names


def _add_tool(where: str, tool, namespace: str | None, functions: list, names: dict) -> None:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise invalid(f"{where}: each tool needs a non-empty 'name'", "tools")
    custom = tool.get("type") == "custom"
    parameters = _CUSTOM_PARAMETERS if custom else tool.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"{where}: 'parameters' must be a JSON Schema object", "tools")
    flat = f"{namespace}{NAMESPACE_JOIN}{tool['name']}" if namespace else tool["name"]
    names[flat] = ToolName(tool["name"], namespace, custom)
    functions.append({"type": "function", "function": {"name": flat, "description": tool.get("description", ""),
                                                       "parameters": parameters}})


def _messages(instructions, items, names: dict[str, ToolName]) -> list[dict]:
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a non-empty string or list of items", "input")
    system = [instructions] if isinstance(instructions, str) and instructions else []
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object", "input")
        message = _item(f"input[{i}]", item, names)
        if message is None:
            continue
        if message["role"] == "system" and not out:
            system.append(message["content"])  # leading instructions: one system prompt
        elif message.get("tool_calls") and out and out[-1]["role"] == "assistant":
            # Text then calls, or several calls: items of one assistant turn.
            out[-1].setdefault("tool_calls", []).extend(message["tool_calls"])
        else:
            out.append(message)
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + out


def _item(where: str, item: dict, names: dict[str, ToolName]) -> dict | None:
    kind = item.get("type", "message")
    if kind == "message":
        return _message(where, item)
    if kind in ("function_call", "custom_tool_call"):
        return _call(where, item)
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = _text(where, item.get("output"))
        return {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output}
    if kind in _SKIPPED_ITEMS:
        return None
    raise invalid(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                  "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)", "input")


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(f"{where}.role must be user, assistant, system or developer, got {role!r}", "input")
    role = "system" if role == "developer" else role
    return {"role": role, "content": _text(where, item.get("content"))}


def _call(where: str, item: dict) -> dict:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}: a function_call needs a 'name'", "input")
    if item.get("namespace"):
        name = f"{item['namespace']}{NAMESPACE_JOIN}{name}"
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
    else:
        arguments = item.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise invalid(f"{where}.arguments must be a JSON string", "input")
    call = {"id": str(item.get("call_id", "")), "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _text(where: str, content) -> str:
    """A string, or text parts joined; images and files are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in (*_TEXT_PARTS, "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}: content parts of type {kind!r} are not supported (text only)", "input")
        texts.append(part.get("text") or part.get("refusal") or "")
    return "".join(texts)
