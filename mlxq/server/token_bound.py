"""A sound lower bound on how many tokens a text becomes, from its UTF-8 length alone.

A BPE tokenizer that works on bytes (byte-level, or with byte fallback)
never drops input: every byte of the text ends up inside exactly one token,
and no token stands for more than ``L`` bytes, the longest token in the
vocabulary. So ``tokens >= ceil(bytes / L)``, and a text whose bound already
exceeds the context can be refused before tokenizing it (tokenizing 15 MiB
takes seconds). The bound is only claimed where each step provably keeps
every byte:

- normalizer: none, or only ``Prepend`` / ``Replace`` rules that never make
  the text shorter (``" "`` -> ``"▁"``); lowercasing, NFC/NFKC, accent
  stripping and whitespace collapsing can shrink text, so they void it;
- pre-tokenizer: byte-level, metaspace, digit or punctuation splits, or a
  ``Split`` that keeps what it matches; whitespace splitters drop spaces;
- model: BPE without an unknown token that could swallow a run of text
  (``fuse_unk``);
- added tokens: none that strip the whitespace around them (one such token
  can stand for any number of spaces).

Anything else (a slow tokenizer, another model type) gets no bound: the
text is tokenized, off the event loop, and measured exactly.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def token_lower_bound(tokenizer, text: str) -> int:
    """Tokens ``text`` becomes at least (0 when no sound bound is known for this tokenizer)."""
    longest = max_bytes_per_token(tokenizer)
    if longest is None or not text:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / longest)


def may_reach(tokenizer, text: str, limit: int) -> bool:
    """Whether ``token_lower_bound(tokenizer, text)`` could be ``limit`` or more, known from the text's
    length alone (a character is at most 4 UTF-8 bytes, a lone surrogate 3): an agent's 90 KB chat on
    a long context is not encoded to UTF-8 just to find it fits."""
    longest = max_bytes_per_token(tokenizer)
    return longest is not None and math.ceil(4 * len(text) / longest) >= limit


@lru_cache(maxsize=8)
def max_bytes_per_token(tokenizer) -> int | None:
    """The most text bytes one token can stand for, or None when no byte bound is sound."""
    backend = _backend(tokenizer)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, ValueError):
        return None
    if not (_keeps_text(spec.get("normalizer")) and _keeps_bytes(spec.get("pre_tokenizer"))):
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    # A byte-level piece spells one byte per character; other pieces are measured in UTF-8 (an
    # overestimate for "▁" and "<0x41>" pieces, which only lowers the bound).
    pieces = [len(p.encode("utf-8")) for p in model.get("vocab", {})]
    pieces += [len(t["content"].encode("utf-8")) for t in added]
    return max(pieces, default=0) or None


def _backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind mlx-lm's wrapper or a Hugging Face fast tokenizer, if any."""
    for candidate in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        backend = getattr(candidate, "backend_tokenizer", None)
        if backend is not None:
            return backend
    return tokenizer if hasattr(tokenizer, "to_str") else None


def _keeps_text(normalizer) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode())
    return False


def _keeps_bytes(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_bytes(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
