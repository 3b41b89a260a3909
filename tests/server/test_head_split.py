"""A chat on a kept system head is tokenized past the head's last special token only, with the same ids.

The first chat on a system prompt is tokenized whole and finds the cut
(server/head_split.py), checked against those tokens; later chats on it
tokenize only the text after the cut. Every chat's ids equal the whole
rendered chat's tokens (what mlx-lm's ``apply_chat_template`` gives),
whatever its question starts with.
"""

from __future__ import annotations

import pytest

from mlxq.server import head_split, system_heads
from mlxq.server.prompts import tokenize_chat

SYSTEM = "You are a careful agent. Follow the rules of the shop, and answer in full. " * 12
QUESTIONS = ["What now?", " leading space", "\n\nnewlines first", "<|im_start|>user pretends", "héllo wörld ✓",
             "", "   ", "<|im_end|>", "1234567890 " * 5]


@pytest.fixture(autouse=True)
def fresh_heads():
    system_heads._heads.clear()
    system_heads._splits.clear()
    yield
    system_heads._heads.clear()
    system_heads._splits.clear()


def chat(system: str, question: str, *more) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}, *more]


def whole(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def test_chats_on_a_kept_head_tokenize_their_tail_only_with_the_same_ids(load_tiny, monkeypatch):
    _, tokenizer = load_tiny("llama")
    encoded = []  # every text the server tokenizes for a chat
    real = head_split.encode
    monkeypatch.setattr(head_split, "encode", lambda tok, text: encoded.append(text) or real(tok, text))
    first = chat(SYSTEM, "Question zero?")
    assert tokenize_chat(tokenizer, first, None, {}) == whole(tokenizer, first)
    [split] = system_heads._splits[tokenizer].values()
    assert split[1].exact and split[1].token in ("<|im_end|>", "<|im_start|>") and SYSTEM in split[1].text
    for question in QUESTIONS:
        encoded.clear()
        messages = chat(SYSTEM, question, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"})
        assert tokenize_chat(tokenizer, messages, None, {}) == whole(tokenizer, messages), question
        assert len(encoded) == 1 and SYSTEM not in encoded[0]  # only the text past the head


def test_a_chat_the_kept_cut_does_not_fit_or_an_inexact_cut_is_tokenized_whole(load_tiny, monkeypatch):
    _, tokenizer = load_tiny("llama")
    tokenize_chat(tokenizer, chat(SYSTEM, "first"), None, {})
    (key, (at, split)), = system_heads._splits[tokenizer].items()
    encoded = []
    real = head_split.encode
    monkeypatch.setattr(head_split, "encode", lambda tok, text: encoded.append(text) or real(tok, text))
    # A template that rendered something else before (the date, say): the kept text is no prefix.
    system_heads._splits[tokenizer][key] = (at, head_split.HeadSplit("<|im_start|>other", split.ids, True))
    messages = chat(SYSTEM, "second")
    assert tokenize_chat(tokenizer, messages, None, {}) == whole(tokenizer, messages)
    assert encoded[-1].startswith("<|im_start|>system") and SYSTEM in encoded[-1]
    # A cut whose check failed is never used.
    system_heads._splits[tokenizer][key] = (at, head_split.HeadSplit(split.text, (1, 2, 3), False))
    assert tokenize_chat(tokenizer, messages, None, {}) == whole(tokenizer, messages)


def test_the_cut_is_checked_against_the_whole_chats_tokens(load_tiny):
    _, tokenizer = load_tiny("llama")
    text = tokenizer.apply_chat_template(chat(SYSTEM, "q"), add_generation_prompt=True, tokenize=False)
    head = tokenizer.apply_chat_template(chat(SYSTEM, ""), add_generation_prompt=False, tokenize=False)
    ids = whole(tokenizer, chat(SYSTEM, "q"))
    found = head_split.find_split(tokenizer, head, text, ids)
    assert found is not None and found.exact and text.startswith(found.text)
    assert not head_split.find_split(tokenizer, head, text, ids[:-1] + [ids[-1] + 1]).exact  # other tokens: no
    assert head_split.find_split(tokenizer, "no special token here", text, ids) is None


def test_a_tokenizer_the_split_does_not_understand_is_tokenized_whole(load_tiny, monkeypatch):
    _, tokenizer = load_tiny("llama")

    def broken(*args):
        raise AttributeError("no added tokens here")

    monkeypatch.setattr(head_split, "special_tokens", broken)
    for question in ("first", "second"):
        messages = chat(SYSTEM, question)
        assert tokenize_chat(tokenizer, messages, None, {}) == whole(tokenizer, messages)
    [(_, split)] = system_heads._splits[tokenizer].values()
    assert split is head_split.NO_SPLIT


def test_the_cut_is_before_the_special_token_so_a_metaspace_first_piece_never_moves():
    """A Metaspace pre-tokenizer with ``prepend_scheme="first"`` marks only the input's first piece:
    cut after ``<x>``, a later chat's ``a`` would be tokenized as the first piece (``▁a``) where the
    whole chat has ``a``. Cut before ``<x>``, the tail always starts with ``<x>``."""
    from types import SimpleNamespace

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581sys": 1, "sys": 2, "\u2581a": 3, "a": 4, "<x>": 5, "\u2581": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.add_special_tokens([AddedToken("<x>", normalized=False, special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer = SimpleNamespace(_tokenizer=fast, encode=fast.encode)  # as mlx-lm's wrapper holds it
    first = "sys<x> a"
    found = head_split.find_split(tokenizer, "sys<x>", first, head_split.encode(tokenizer, first))
    assert found is not None and found.exact and found.token == "<x>"
    for later in ("sys<x>a", "sys<x> a", "sys<x>"):
        split = list(found.ids) + head_split.encode(tokenizer, later[len(found.text):])
        assert split == head_split.encode(tokenizer, later), later
