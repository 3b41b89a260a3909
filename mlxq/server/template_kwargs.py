"""``chat_template_kwargs``: the few plain values a chat template may read, and nothing that changes the template.

A client may set variables the model's template reads (``enable_thinking``,
``reasoning_effort``...). It may not replace the template (``chat_template``
would run the client's own Jinja on the server), change how the result is
tokenized or returned (``tokenize``, ``return_*``, ``padding``, ``truncation``,
``max_length``), or pass the conversation through a side door.
"""

from __future__ import annotations

import math
import re

from mlxq.server.errors import APIError, invalid

PARAM = "chat_template_kwargs"
MAX_KWARGS = 32
MAX_STRING_CHARS = 4096
MAX_INT = 2**53  # what every JSON reader represents exactly
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
RESERVED = frozenset({"chat_template", "tokenize", "padding", "truncation", "max_length", "tools", "documents",
                      "messages", "conversation", "add_generation_prompt", "continue_final_message",
                      "tokenizer_kwargs", "processor_kwargs"})


def read_template_kwargs(body: dict) -> dict:
    """The request's template variables, each a plain JSON scalar under a plain name; else a 400."""
    raw = body.get(PARAM)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid(f"'{PARAM}' must be an object, got {type(raw).__name__}", PARAM)
    if len(raw) > MAX_KWARGS:
        raise invalid(f"'{PARAM}' accepts at most {MAX_KWARGS} entries", PARAM)
    for name, value in raw.items():
        _check_name(name)
        _check_value(name, value)
    return dict(raw)


def check_server_template_args(args: dict) -> None:
    """``--chat-template-args`` obey the same rules as a request's kwargs; else a ValueError naming the flag."""
    try:
        read_template_kwargs({PARAM: args})
    except APIError as exc:
        raise ValueError(f"--chat-template-args: {exc.message}") from None


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise invalid(f"'{PARAM}' names must be plain identifiers, got {name[:80]!r}", PARAM)
    if name in RESERVED or name.startswith("return_"):
        raise invalid(f"'{PARAM}.{name}' is not allowed: template variables may not replace the template or "
                      "change how it is tokenized", PARAM)


def _check_value(name: str, value) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise invalid(f"'{PARAM}.{name}' is out of range (at most 2**53 in magnitude)", PARAM)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise invalid(f"'{PARAM}.{name}' must be finite", PARAM)
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise invalid(f"'{PARAM}.{name}' is longer than {MAX_STRING_CHARS} characters", PARAM)
        return
    raise invalid(f"'{PARAM}.{name}' must be a string, number, boolean or null, got {type(value).__name__}", PARAM)
