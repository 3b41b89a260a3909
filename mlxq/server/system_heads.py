"""The token ids of a chat's leading system messages, rendered once per system prompt.

Every chat request with a system prompt is rendered twice: the whole chat
(its prompt) and its system messages before an empty user turn (where
the shared system prompt ends: ``prompts.system_prefix_length``, a
prompt-cache snapshot point). Agents send the same system prompt again
and again, so the second render and its tokenization (about half of a
request's parsing, done on the server's threads under the GIL before the
request reaches the engine) are kept here, per tokenizer, keyed by the
system messages, tools and template arguments. An entry lives
``MAX_AGE_S`` (templates may render the date) and at most ``KEPT`` are
kept (least recently used out). A stale or colliding entry can only move
the snapshot point: the caller keeps the common prefix with the prompt.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

KEPT = 32
MAX_AGE_S = 60.0

_lock = threading.Lock()
_heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> OrderedDict(key -> (time, ids))


def system_head(tokenizer, system: list, tools, template_kwargs: dict,
                compute: Callable[[], list[int] | None]) -> list[int] | None:
    """``compute()`` (the system messages' token ids, or None), or what it gave for the same
    arguments less than ``MAX_AGE_S`` ago."""
    try:
        key = json.dumps([system, tools, template_kwargs], sort_keys=True, default=str)
        with _lock:
            entries = _heads.setdefault(tokenizer, OrderedDict())
    except TypeError:  # a tokenizer that takes no weak reference: nothing is kept
        return compute()
    now = time.monotonic()
    with _lock:
        found = entries.get(key)
        if found is not None and now - found[0] < MAX_AGE_S:
            entries.move_to_end(key)
            return found[1]
    ids = compute()
    with _lock:
        entries[key] = (now, ids)
        entries.move_to_end(key)
        while len(entries) > KEPT:
            entries.popitem(last=False)
    return ids
