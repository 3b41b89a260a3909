"""``json.loads`` for large bodies, in pieces the event loop can interleave with.

``json.loads`` is one C call: it holds the GIL until the whole document is
built, so 100k messages (~300 ms of parsing) stall the event loop and the
engine thread for all of it, worker thread or not. Decoding a top-level
object's arrays one element at a time gives the interpreter a switch point
after each element. The result equals ``json.loads(text)``; anything this
reader does not expect is handed to ``json.loads``, which decodes it or
names the error exactly as before.
"""

from __future__ import annotations

import json
import re

_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's four whitespace characters
_decoder = json.JSONDecoder()


class _Unexpected(ValueError):
    pass


def loads_in_pieces(text: str):
    try:
        return _document(text)
    except (ValueError, IndexError):
        return json.loads(text)


def _skip(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def _expect(text: str, i: int, chars: str) -> str:
    if text[i] not in chars:
        raise _Unexpected(i)
    return text[i]


def _document(text: str) -> dict:
    i = _skip(text, 0)
    _expect(text, i, "{")
    out: dict = {}
    i = _skip(text, i + 1)
    if text[i] == "}":
        i += 1
    else:
        while True:
            key, i = _decoder.raw_decode(text, i)
            if not isinstance(key, str):
                raise _Unexpected(i)
            i = _skip(text, i)
            _expect(text, i, ":")
            i = _skip(text, i + 1)
            out[key], i = _array(text, i) if text[i] == "[" else _decoder.raw_decode(text, i)
            i = _skip(text, i)
            if _expect(text, i, ",}") == "}":
                i += 1
                break
            i = _skip(text, i + 1)
    if _skip(text, i) != len(text):
        raise _Unexpected(i)
    return out


def _array(text: str, i: int) -> tuple[list, int]:
    items: list = []
    i = _skip(text, i + 1)
    if text[i] == "]":
        return items, i + 1
    while True:
        item, i = _decoder.raw_decode(text, i)
        items.append(item)
        i = _skip(text, i)
        if _expect(text, i, ",]") == "]":
            return items, i + 1
        i = _skip(text, i + 1)
