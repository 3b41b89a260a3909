"""A chat's tokens after its kept system head: only the text past the head's last special token is tokenized.

Agents resend one system prompt of thousands of tokens with a short turn
after it; tokenizing the whole rendered chat per request is most of what
the server spends on it before the engine sees it. A tokenizer splits its
input at special (added) tokens before normalizing and pre-tokenizing
each piece, so the tokens of a chat cut right after a special token are
the tokens of the part before followed by those of the part after. The
cut is the last special token that the chat shares with its system
messages rendered alone (``prompts.system_prefix_length``'s head); the part
before it is tokenized once per head (kept with the heads,
server/system_heads.py), the rest per request. Whether the cut is exact
for this tokenizer and template is checked once per head, on the chat it
was found on, by comparing with the whole chat's tokens; a head whose
check failed, or a chat that does not start with the kept text (a template
that renders the date, say), is tokenized whole.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from mlxq.server.system_heads import keep, kept

log = logging.getLogger("mlxq.server")


@dataclass(frozen=True)
class HeadSplit:
    """Where chats on one system head are cut, and the tokens before the cut."""

    text: str  # the rendered chat up to and including a special token
    ids: tuple[int, ...]  # its tokens
    exact: bool  # the whole chat's tokens were ``ids`` + the rest's tokens on the chat it was found on


NO_SPLIT = HeadSplit("", (), False)  # tokenize whole (no cut found, or one being found)


def encode_chat(tokenizer, text: str, system: list, tools, template_kwargs: dict, head_text) -> list[int]:
    """``text``'s token ids (``text``: a rendered chat whose leading messages are ``system``);
    ``head_text()``: those messages rendered alone, before an empty user turn (None: no head)."""
    parts = [system, tools, template_kwargs]
    split = kept(tokenizer, "split", parts)
    if split is not None:
        if split.exact and text.startswith(split.text):
            return list(split.ids) + encode(tokenizer, text[len(split.text):])
        return encode(tokenizer, text)
    keep(tokenizer, "split", parts, NO_SPLIT)  # a burst's other first chats tokenize whole meanwhile
    ids = encode(tokenizer, text)
    try:
        head = head_text()
        found = find_split(tokenizer, head, text, ids) if head else None
    except Exception:  # an optimization: a tokenizer it does not understand is tokenized whole
        log.warning("no head split for this tokenizer", exc_info=True)
        found = None
    keep(tokenizer, "split", parts, found or NO_SPLIT)
    return ids


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))  # what apply_chat_template(tokenize=True) does


def find_split(tokenizer, head: str, text: str, ids: list[int]) -> HeadSplit | None:
    """The cut after the last special token ``head`` and ``text`` share, checked against ``text``'s
    tokens ``ids``; None when they share none."""
    shared = len(os.path.commonprefix([head, text]))  # once per head
    ends = [end for token in special_tokens(tokenizer) for end in _ends(text, token, shared)]
    if not ends:
        return None
    cut = max(ends)
    before = encode(tokenizer, text[:cut])
    return HeadSplit(text[:cut], tuple(before), before + encode(tokenizer, text[cut:]) == ids)


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special added tokens matched on the raw text (cut out before normalization)."""
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(backend, "added_tokens_decoder", None) or {}
    return [t.content for t in added.values() if t.special and not t.normalized and t.content]


def _ends(text: str, token: str, limit: int) -> list[int]:
    """Where each occurrence of ``token`` in ``text[:limit]`` ends."""
    out, start = [], text.find(token, 0, limit)
    while start >= 0:
        out.append(start + len(token))
        start = text.find(token, start + len(token), limit)
    return out
