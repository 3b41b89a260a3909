"""Anthropic Messages requests, read into the chat form the chat template and the engine take.

``system`` (a string or text blocks) becomes a system message; content blocks
become chat messages: ``text`` joins, ``tool_use`` becomes an assistant tool
call, ``tool_result`` a tool message. Tools' ``input_schema`` is their
parameters. Fields mlxq cannot honour but that do not change what a client
may rely on (``thinking``, ``cache_control``, ``metadata``, ``context_management``,
server tools such as web search...) are accepted and ignored; see docs/clients.md.
``tool_choice`` any/tool and ``output_config.format`` are enforced by a grammar (structured.py).
"""

from __future__ import annotations

import json

from mlxq.server.errors import invalid
from mlxq.server.protocol import GenerationSpec, TokenLimits, parse_generation
from mlxq.server.request_defaults import PROTOCOL_DEFAULTS, RequestDefaults

ANTHROPIC_DEFAULT_TEMPERATURE = 1.0  # the Messages API's default


def parse_messages(body, lm, limits: TokenLimits, defaults: RequestDefaults = PROTOCOL_DEFAULTS) -> GenerationSpec:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if "max_tokens" not in body:
        raise invalid("'max_tokens' is required", "max_tokens")
    chat = {
        "model": body.get("model"),
        "messages": _system(body.get("system")) + _messages(body.get("messages")),
        "max_tokens": body.get("max_tokens"),
        "stop": _stop_sequences(body.get("stop_sequences")),
        "temperature": body.get("temperature", defaults.get("temperature", ANTHROPIC_DEFAULT_TEMPERATURE)),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stream": body.get("stream"),
        "response_format": _response_format(body.get("output_config")),
        **_tools(body.get("tools"), body.get("tool_choice")),
    }
    return parse_generation(chat, "chat", lm, limits, defaults)


def parse_count_tokens(body, lm, defaults: RequestDefaults = PROTOCOL_DEFAULTS) -> int:
    """Prompt tokens of a Messages body (max_tokens is not part of it)."""
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    return len(parse_messages(body, lm, TokenLimits(), defaults).prompt_ids)


def _system(system) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text_of(system, "system")}]


def _text_of(content, where: str) -> str:
    """A string, or text blocks joined (other blocks here are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or a list of text blocks", where)
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"'{where}' blocks must be {{\"type\": \"text\", \"text\": ...}}", where)
        parts.append(block["text"])
    return "".join(parts)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    out: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"messages[{i}] must be an object with role 'user' or 'assistant'", "messages")
        content = message.get("content")
        if message["role"] == "system":  # Claude Code puts reminders between turns as system messages
            out.append({"role": "system", "content": _text_of(content, f"messages[{i}].content")})
        elif isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out.extend(_blocks(i, message["role"], content))
        else:
            raise invalid(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    return out


def _blocks(i: int, role: str, blocks: list) -> list[dict]:
    """One Anthropic message's blocks as chat messages, in order: tool results, then text and calls."""
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(where, block))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(where, block))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' reasoning: the model here does not read it back
        else:
            raise invalid(f"{where}: a {kind!r} block is not supported in a {role} message "
                          "(text, tool_use in assistant turns, tool_result in user turns)", "messages")
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _tool_use(where: str, block: dict) -> dict:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise invalid(f"{where}: tool_use needs a 'name' and an object 'input'", "messages")
    return {"id": str(block.get("id", "")), "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}}


def _tool_result(where: str, block: dict) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    elif not isinstance(content, str):
        raise invalid(f"{where}: tool_result content must be a string or a list of blocks", "messages")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content}


def _stop_sequences(stops):
    if stops is not None and not isinstance(stops, list):
        raise invalid("'stop_sequences' must be a list of strings", "stop_sequences")
    return stops


def _tools(tools, tool_choice) -> dict:
    """Custom tools as chat function tools; Anthropic's server tools (web search...) are left out."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object", "tools")
        if tool.get("type", "custom") != "custom":
            continue  # a server tool Anthropic runs itself: there is no such thing here
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise invalid(f"tools[{i}] needs a 'name' and an 'input_schema' object", "tools")
        functions.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""), "parameters": tool["input_schema"]}})
    choice = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if tool_choice is not None and choice not in ("auto", "any", "tool", "none"):
        raise invalid("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    if choice == "tool" and tool_choice.get("name") not in {f["function"]["name"] for f in functions}:
        raise invalid(f"tool_choice names {tool_choice.get('name')!r}, which is not among 'tools'", "tool_choice")
    if not functions or choice == "none":
        return {}
    # any / tool force a call: chat completions' "required" / named function, enforced by a grammar.
    forced = {"any": "required", "tool": {"type": "function", "function": {"name": (tool_choice or {}).get("name")}}}
    return {"tools": functions, "tool_choice": forced.get(choice, "auto")}


def _response_format(output_config) -> dict | None:
    """``output_config.format`` (a JSON schema the reply must match) as chat's ``response_format``."""
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                      "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
