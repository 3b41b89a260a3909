"""A chat's tokens after its kept system head: only the text from the head's last special token on is tokenized.

Agents resend one system prompt of thousands of tokens with a short turn
after it; tokenizing the whole rendered chat per request is most of what
the server spends on it before the engine sees it. A tokenizer splits its
input at special (added) tokens before normalizing and pre-tokenizing
each piece, so the tokens of a chat cut right before a special token are
the tokens of the part before followed by those of the part after, which
starts with that token. The cut is before the last special token that the
chat shares with its system messages rendered alone
(``prompts.system_prefix_length``'s head), so what follows the cut is the
head's own text whatever the user wrote (a cut after the token would let
a pre-tokenizer that treats a piece's first character specially, such as
a Metaspace prefix, see each chat's own first character). Tokens that
strip whitespace around them or match whole words only are never cut at.
The part before the cut is tokenized once per head (kept with the heads,
server/system_heads.py), the rest per request. Whether the cut is exact
for this tokenizer and template is checked once per head, on the chat it
was found on, by comparing with the whole chat's tokens; a head whose
check failed, or a chat that does not continue with the kept text and the
special token (a template that renders the date, say), is tokenized whole.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from mlxq.server.offload import INLINE_TEXT_CHARS, leave_loop_if
from mlxq.server.system_heads import keep, kept, renew

log = logging.getLogger("mlxq.server")


@dataclass(frozen=True)
class HeadSplit:
    """Where chats on one system head are cut, and the tokens before the cut."""

    text: str  # the rendered chat up to a special token
    ids: tuple[int, ...]  # its tokens
    exact: bool  # the whole chat's tokens were ``ids`` + the rest's tokens on the chat it was found on
    token: str = ""  # the special token that follows ``text`` in every chat on this head


NO_SPLIT = HeadSplit("", (), False)  # tokenize whole (no cut found, or one being found)


def encode_chat(tokenizer, text: str, system: list, tools, template_kwargs: dict, head_text) -> list[int]:
    """``text``'s token ids (``text``: a rendered chat whose leading messages are ``system``);
    ``head_text()``: those messages rendered alone, before an empty user turn (None: no head)."""
    parts = [system, tools, template_kwargs]
    split = kept(tokenizer, "split", parts)
    if split is not None:
        if split.exact and text.startswith(split.text) and text.startswith(split.token, len(split.text)):
            ids = list(split.ids)  # shared int objects (``shared_ids``)
            ids += encode(tokenizer, text[len(split.text):])
            renew(tokenizer, "split", parts)  # true of this chat: kept on while agents use it
            return ids
        return shared_ids(encode(tokenizer, text))
    leave_loop_if(len(text) >= INLINE_TEXT_CHARS)  # before keeping anything: the parse starts over
    keep(tokenizer, "split", parts, NO_SPLIT)  # a burst's other first chats tokenize whole meanwhile
    ids = shared_ids(encode(tokenizer, text))
    try:
        head = head_text()
        found = find_split(tokenizer, head, text, ids) if head else None
    except Exception:  # an optimization: a tokenizer it does not understand is tokenized whole
        log.warning("no head split for this tokenizer", exc_info=True)
        found = None
    keep(tokenizer, "split", parts, found or NO_SPLIT)
    return ids


def encode(tokenizer, text: str) -> list[int]:
    leave_loop_if(len(text) >= INLINE_TEXT_CHARS)  # a long text is tokenized in a worker thread
    return list(tokenizer.encode(text, add_special_tokens=False))  # what apply_chat_template(tokenize=True) does


def shared_ids(ids: list[int]) -> list[int]:
    """``ids`` made of one int object per token id, the same in every prompt built here: a chat's ids,
    its head's (``prompts._common_length``) and the engine's prefix tree (built from earlier prompts)
    are then compared by identity, not by value, for their common part (16k ids: ~3x faster). Costs
    ~0.2 ms per 16k ids, paid where a text is tokenized whole (once per system prompt, or a burst's
    first chats)."""
    top = max(ids, default=-1)
    if top >= len(_INTS):
        with _ints_lock:
            _INTS.extend(range(len(_INTS), top + 1))
    if ids and min(ids) < 0:
        return ids
    return list(map(_INTS.__getitem__, ids))


_INTS: list[int] = []  # token id -> its shared int object
_ints_lock = threading.Lock()


def find_split(tokenizer, head: str, text: str, ids: list[int]) -> HeadSplit | None:
    """The cut before the last special token ``head`` and ``text`` share (past the text's start),
    checked against ``text``'s tokens ``ids``; None when they share none."""
    shared = len(os.path.commonprefix([head, text]))  # once per head
    starts = [(start, token) for token in special_tokens(tokenizer) for start in _starts(text, token, shared)]
    starts = [(start, token) for start, token in starts if start > 0]
    if not starts:
        return None
    cut, token = max(starts)
    before = shared_ids(encode(tokenizer, text[:cut]))
    return HeadSplit(text[:cut], tuple(before), before + encode(tokenizer, text[cut:]) == ids, token)


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special added tokens matched on the raw text (cut out before normalization),
    without those that take whitespace around them or match whole words only (their pieces'
    edges depend on the text beside them)."""
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(backend, "added_tokens_decoder", None) or {}
    plain = [t for t in added.values() if t.special and not t.normalized and t.content]
    edges = ("lstrip", "rstrip", "single_word")
    return [t.content for t in plain if not any(getattr(t, flag, False) for flag in edges)]


def _starts(text: str, token: str, limit: int) -> list[int]:
    """Where each whole occurrence of ``token`` in ``text[:limit]`` starts."""
    out, start = [], text.find(token, 0, limit)
    while start >= 0:
        out.append(start)
        start = text.find(token, start + len(token), limit)
    return out
