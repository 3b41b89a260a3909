"""The token ids of a chat's leading system messages, rendered once per system prompt.

Every chat request with a system prompt is rendered twice: the whole chat
(its prompt) and its system messages before an empty user turn (where
the shared system prompt ends: ``prompts.system_prefix_length``, a
prompt-cache snapshot point). Agents send the same system prompt again
and again, so the second render and its tokenization (about half of a
request's parsing, done on the server's threads under the GIL before the
request reaches the engine) are kept here, per tokenizer, keyed by the
system messages, tools and template arguments. An entry lives
``MAX_AGE_S`` (templates may render the date) from when it was kept or
last found true of a chat (``renew``), and at most ``KEPT`` are kept
(least recently used out). A stale or colliding entry can only move
the snapshot point: the caller keeps the common prefix with the prompt.
Where chats on a head are cut for tokenizing (server/head_split.py) is
kept alike, apart.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

KEPT = 32
MAX_AGE_S = 60.0
MAX_KEY_DEPTH = 64

_lock = threading.Lock()
_heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> OrderedDict(key -> (time, ids))
_splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same for head_split.HeadSplit
_STORES = {"head": _heads, "split": _splits}


def system_head(tokenizer, system: list, tools, template_kwargs: dict,
                compute: Callable[[], list[int] | None]) -> list[int] | None:
    """``compute()`` (the system messages' token ids, or None), or what it gave for the same
    arguments less than ``MAX_AGE_S`` ago."""
    parts = [system, tools, template_kwargs]
    found = kept(tokenizer, "head", parts, _MISSING)
    if found is not _MISSING:
        return found
    ids = compute()
    keep(tokenizer, "head", parts, ids)
    return ids


_MISSING = object()


def kept(tokenizer, kind: str, parts: list, default=None):
    """What ``keep`` kept for ``tokenizer``, ``kind`` and ``parts`` less than ``MAX_AGE_S`` ago, else ``default``."""
    key = _key(kind, parts)
    if key is None:
        return default
    with _lock:
        try:
            entries = _STORES[kind].get(tokenizer)
        except TypeError:  # a tokenizer that takes no weak reference: nothing was kept
            return default
        found = None if entries is None else entries.get(key)
        if found is None or time.monotonic() - found[0] >= MAX_AGE_S:
            return default
        entries.move_to_end(key)
        return found[1]


def renew(tokenizer, kind: str, parts: list) -> None:
    """Start ``MAX_AGE_S`` again for what is kept for ``parts``: its caller found it still true of a
    chat (an entry in use lives on; one a template's changing text no longer matches runs out)."""
    key = _key(kind, parts)
    if key is None:
        return
    with _lock:
        try:
            entries = _STORES[kind].get(tokenizer)
        except TypeError:  # a tokenizer that takes no weak reference: nothing was kept
            return
        found = None if entries is None else entries.get(key)
        if found is not None:
            entries[key] = (time.monotonic(), found[1])


def keep(tokenizer, kind: str, parts: list, value) -> None:
    """Keep ``value`` for ``tokenizer``, ``kind`` and ``parts`` (the least recently used past ``KEPT`` go)."""
    key = _key(kind, parts)
    if key is None:
        return
    with _lock:
        try:
            entries = _STORES[kind].setdefault(tokenizer, OrderedDict())
        except TypeError:  # a tokenizer that takes no weak reference: nothing is kept
            return
        entries[key] = (time.monotonic(), value)
        entries.move_to_end(key)
        while len(entries) > KEPT:
            entries.popitem(last=False)


def _key(kind: str, parts: list) -> tuple | None:
    """``parts`` as a hashable value, each value with its type (``True`` is not ``1``). Built per
    request: the strings in it are the request's own, hashed once each (a 90 KB system prompt: ~0.05
    ms; its JSON text took ~0.4 ms to write), and a hit compares them in C."""
    try:
        return _frozen(parts, 0)
    except (TypeError, ValueError, RecursionError):
        return None


def _frozen(value, depth: int):
    if depth > MAX_KEY_DEPTH:
        raise ValueError("nested too deep for a key")
    if isinstance(value, dict):
        items = sorted(((str(k), _frozen(v, depth + 1)) for k, v in value.items()), key=_first)
        return dict, tuple(items)
    if isinstance(value, (list, tuple)):
        return list, tuple(_frozen(v, depth + 1) for v in value)
    if value is None or isinstance(value, (str, int, float)):
        return type(value), value
    return str, str(value)  # as the JSON key wrote other objects (default=str)


def _first(item: tuple):
    return item[0]
