"""The byte-length bound on token counts never exceeds the real count, and is refused where it is unsound."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE

from mlxq.golden.cases import ARCHS
from mlxq.server.token_bound import max_bytes_per_token, may_reach, token_lower_bound


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in (*range(32, 127), *range(0xA0, 0x250), *range(0x4E00, 0x4E80), 0x1F600, 0x1F680)]
    texts = ["", " ", " " * 5000, "\n\n\t" * 300, "é" * 700, "<|im_start|>user\nhi<|im_end|>" * 40,
             "<|endoftext|>" * 100, "a" * 9000, "🙂" * 500]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(40)]
    texts += [" ".join(rng.choice(["the", "cat", "  ", "\u200b", "Ω", "1234567"]) for _ in range(800))]
    return texts


@pytest.mark.parametrize("arch", ARCHS)
def test_the_bound_holds_for_every_text(load_tiny, arch):
    _, tokenizer = load_tiny(arch)
    assert max_bytes_per_token(tokenizer) is not None  # the tiny models' tokenizers are byte-level BPE
    for text in _texts(hash(arch) % 1000):
        exact = len(tokenizer.encode(text, add_special_tokens=False))
        assert token_lower_bound(tokenizer, text) <= exact, text[:40]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_text_cleared_by_its_length_never_reaches_the_limit_by_its_bound(load_tiny, arch):
    """``may_reach`` false means the bound is under the limit: skipping the bound there refuses nothing
    the bound would have refused. Limits around each text's bound, and far above it."""
    _, tokenizer = load_tiny(arch)
    cleared = 0
    for text in _texts(hash(arch) % 1000) + ["\ud800" * 300, "x" * 90_000]:
        bound = token_lower_bound(tokenizer, text)
        for limit in (1, bound - 1, bound, bound + 1, 4 * bound + 8, 10 * len(text) + 1):
            if not may_reach(tokenizer, text, limit):
                cleared += 1
                assert bound < limit, (text[:40], limit)
    assert cleared > 40  # the length alone clears long texts on a long context


def _bpe(normalizer=None, pre_tokenizer=None) -> Tokenizer:
    tok = Tokenizer(BPE({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, [("a", "b")], unk_token="[UNK]"))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return tok


@pytest.mark.parametrize("tokenizer, sound", [
    (_bpe(pre_tokenizer=pre_tokenizers.ByteLevel()), True),
    (_bpe(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
          pre_tokenizers.Metaspace()), True),
    (_bpe(normalizers.Lowercase()), False),  # "İ" lowercases to fewer... or more bytes: no claim either way
    (_bpe(normalizers.NFKC()), False),
    (_bpe(normalizers.StripAccents()), False),  # drops combining marks: text shrinks without bound
    (_bpe(normalizers.Replace("  ", " ")), False),  # collapses whitespace
    (_bpe(pre_tokenizer=pre_tokenizers.Whitespace()), False),  # drops spaces
])
def test_the_bound_is_claimed_only_where_every_byte_is_kept(tokenizer, sound):
    assert (max_bytes_per_token(tokenizer) is not None) == sound
