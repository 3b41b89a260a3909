"""Prompts to token ids: chat messages through the model's chat template, raw text as is."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from mlxq.server.errors import APIError, invalid
from mlxq.server.head_split import encode, encode_chat, shared_ids
from mlxq.server.offload import INLINE_TEXT_CHARS, leave_loop_if, parsing_inline
from mlxq.server.system_heads import renew, system_head
from mlxq.server.token_bound import may_reach, token_lower_bound

# The model's own template (a client cannot supply one: server/template_kwargs.py) still runs with a budget,
# in a worker thread: a render that outlives it is refused, and the caller stops waiting for it.
RENDER_TIMEOUT_S = 10.0
MAX_RENDERED_CHARS = 64 * 2**20
# A small body's chat of at most this many messages renders on the event loop, without the budget (server/
# offload.py): a template whose work grows with the square of the turns stays in the budgeted thread.
MAX_INLINE_MESSAGES = 64
_renderers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mlxq-template")

ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_message(i: int, message) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                    "images and audio are not supported",
                    "messages",
                )
    elif content is None:
        if not (role == "assistant" and message.get("tool_calls")):
            raise invalid(f"{where}.content is required", "messages")
    elif not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", "messages")
    if message.get("name") is not None and not isinstance(message["name"], str):
        raise invalid(f"{where}.name must be a string", "messages")
    if message.get("tool_calls") is not None:
        _check_tool_calls(where, message)


def _check_tool_calls(where: str, message: dict) -> None:
    """An assistant turn's earlier tool calls, as OpenAI sends them back: the chat template reads
    ``function.name`` and ``function.arguments`` (a JSON string, or an object some templates take)."""
    calls = message["tool_calls"]
    if message.get("role") != "assistant":
        raise invalid(f"{where}.tool_calls is only valid on assistant messages", "messages")
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list", "messages")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), (str, dict))):
            raise invalid(f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"arguments\": ...}}", "messages")


def tokenize_chat(tokenizer, messages, tools, template_kwargs: dict, context_length: int | None = None) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        _check_message(i, message)
    if not tokenizer.has_chat_template:
        raise invalid("this model has no chat template: use /v1/completions", "messages")
    text = render_chat(tokenizer, messages, tools, template_kwargs, add_generation_prompt=True)
    refuse_if_it_cannot_fit(tokenizer, text, context_length, "messages")
    leading = _leading_system(messages)
    if leading == 0 or leading == len(messages):
        return encode(tokenizer, text)
    # Agents resend one system prompt: its part of the text is tokenized once (server/head_split.py).
    return encode_chat(tokenizer, text, messages[:leading], tools, template_kwargs,
                       lambda: _head_text(tokenizer, messages[:leading], tools, template_kwargs))


def _leading_system(messages: list) -> int:
    """How many messages lead with the system (or developer) role."""
    leading = 0
    while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
        leading += 1
    return leading


def _head_text(tokenizer, system: list, tools, template_kwargs: dict) -> str | None:
    """The system messages rendered before an empty user turn: where agents' chats part (None when the
    template insists on more)."""
    try:
        return render_chat(tokenizer, system + [{"role": "user", "content": ""}], tools, template_kwargs,
                           add_generation_prompt=False)
    except APIError:
        return None


def render_chat(tokenizer, messages, tools, template_kwargs: dict, *, add_generation_prompt: bool) -> str:
    """The chat template's text, within ``RENDER_TIMEOUT_S`` and ``MAX_RENDERED_CHARS``; else a 400.
    A short chat in a small body (parsed on the event loop: server/offload.py) renders on the calling thread."""
    render = functools.partial(tokenizer.apply_chat_template, messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs)
    inline = parsing_inline.get()
    leave_loop_if(len(messages) > MAX_INLINE_MESSAGES)  # many turns: in a worker thread, within the budget
    try:
        text = render() if inline else _renderers.submit(render).result(timeout=RENDER_TIMEOUT_S)
    except FutureTimeout:
        raise invalid(f"the chat template took longer than {RENDER_TIMEOUT_S:g} s on these messages",
                      "messages", "template_timeout") from None
    except Exception as exc:  # jinja errors, template raise_exception()
        raise invalid(f"the chat template rejected these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise invalid("the chat template did not render text", "messages")
    if len(text) > MAX_RENDERED_CHARS:
        raise invalid(f"the rendered chat is longer than {MAX_RENDERED_CHARS} characters", "messages",
                      "template_too_large")
    return text


def refuse_if_it_cannot_fit(tokenizer, text: str, context_length: int | None, param: str) -> None:
    """A 400 before tokenizing when ``text`` provably has more tokens than the context holds."""
    if context_length is None or not may_reach(tokenizer, text, context_length):
        return
    at_least = token_lower_bound(tokenizer, text)
    if at_least >= context_length:  # a prompt must leave room for one generated token
        raise APIError(400, f"the prompt is at least {at_least} tokens ({len(text.encode('utf-8', 'replace'))} "
                            f"bytes), and the model's context is {context_length}: shorten the prompt",
                       param=param, code="context_length_exceeded")


def tokenize_completion(tokenizer, prompt, context_length: int | None = None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        refuse_if_it_cannot_fit(tokenizer, prompt, context_length, "prompt")
        leave_loop_if(len(prompt) >= INLINE_TEXT_CHARS)
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("'prompt' as a list of prompts (a batch) is not supported yet: send one request per prompt",
                      "prompt", "unsupported")
    raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")


def system_prefix_length(tokenizer, messages, tools, template_kwargs: dict, prompt_ids: list[int]) -> int | None:
    """Tokens of ``prompt_ids`` that render the leading system message(s): a boundary many
    agents share, worth its own prompt-cache snapshot. None when there is no system prefix."""
    leading = _leading_system(messages)
    if leading == 0 or leading == len(messages):
        return None

    def render_head() -> list[int] | None:
        text = _head_text(tokenizer, messages[:leading], tools, template_kwargs)
        return None if text is None else shared_ids(encode(tokenizer, text))

    head = system_head(tokenizer, messages[:leading], tools, template_kwargs, render_head)
    if head is None:
        return None
    common = _common_length(head, prompt_ids)
    if common >= len(head) - NEAR_END:  # the chat parts from it where chats do: kept on while in use
        renew(tokenizer, "head", [messages[:leading], tools, template_kwargs])
    return common or None


NEAR_END = 32  # a chat parts from its system head within the head's last this many tokens (its empty user turn)


def _common_length(head: list[int], prompt_ids: list[int], near_end: int = NEAR_END) -> int:
    """How many leading ids ``head`` and ``prompt_ids`` share. The head ends with an empty user turn, so a
    chat parts from it within its last few tokens: one list comparison in C up to there, then a short walk
    (0.06 ms on a 6.7k-token head, where a walk from the start took 0.15 ms, on the event loop). A head
    and a chat on it hold the same int objects (``head_split.shared_ids``): the comparison passes them
    by identity."""
    n = min(len(head), len(prompt_ids))
    at = max(0, n - near_end)
    if head[:at] != prompt_ids[:at]:
        at = 0  # they part earlier: walk from the start
    while at < n and head[at] == prompt_ids[at]:
        at += 1
    return at
