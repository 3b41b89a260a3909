"""A chat's system head (its system messages rendered and tokenized) is computed once per system prompt.

``prompts.system_prefix_length`` (the prompt-cache snapshot point of every
chat with a system prompt) renders the system messages a second time;
agents resend the same system prompt, so the head is kept
(server/system_heads.py) and every later request reuses it, with the same
snapshot point as a fresh render.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxq.server import system_heads
from mlxq.server.prompts import _common_length, system_prefix_length, tokenize_chat

SYSTEM = "You are a careful agent. Follow the rules of the shop. " * 20


@pytest.fixture(autouse=True)
def fresh_heads():
    system_heads._heads.clear()
    yield
    system_heads._heads.clear()


def messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def snapshot_at(tokenizer, msgs, tools=None) -> int | None:
    return system_prefix_length(tokenizer, msgs, tools, {}, tokenize_chat(tokenizer, msgs, tools, {}))


def test_agents_on_one_system_prompt_share_one_rendered_head(load_tiny):
    _, tokenizer = load_tiny("llama")
    points = [snapshot_at(tokenizer, messages(SYSTEM, f"Question {i}: what now?")) for i in range(5)]
    entries = system_heads._heads[tokenizer]
    assert len(entries) == 1
    system_heads._heads.clear()  # each computed afresh: the same snapshot points
    fresh = []
    for i in range(5):
        fresh.append(snapshot_at(tokenizer, messages(SYSTEM, f"Question {i}: what now?")))
        system_heads._heads.clear()
    assert points == fresh and points[0] is not None and len(set(points)) == 1
    head = tokenizer.encode(tokenizer.apply_chat_template(messages(SYSTEM, "")[:1] + [{"role": "user", "content": ""}],
                                                          tokenize=False), add_special_tokens=False)
    assert points[0] <= len(head)


def test_another_system_prompt_or_tools_get_their_own_head_and_old_ones_expire(load_tiny, monkeypatch):
    _, tokenizer = load_tiny("llama")
    snapshot_at(tokenizer, messages(SYSTEM, "a?"))
    snapshot_at(tokenizer, messages("Another shop. " + SYSTEM, "a?"))
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}]
    snapshot_at(tokenizer, messages(SYSTEM, "a?"), tools)
    entries = system_heads._heads[tokenizer]
    assert len(entries) == 3
    kept = entries[next(iter(entries))]
    monkeypatch.setattr(system_heads, "MAX_AGE_S", 0.0)
    snapshot_at(tokenizer, messages(SYSTEM, "b?"))
    assert len(entries) == 3 and entries[next(reversed(entries))] is not kept  # rendered again
    monkeypatch.setattr(system_heads, "KEPT", 2)
    snapshot_at(tokenizer, messages("A third shop. " + SYSTEM, "a?"))
    assert len(entries) == 2


@pytest.mark.parametrize("parts_at", [0, 1, 100, 460, 479, 480])
def test_a_head_and_a_prompt_share_exactly_their_common_ids_wherever_they_part(parts_at):
    head = list(range(1000, 1480))  # 480 ids; the prompt follows it up to ``parts_at``, then differs
    prompt = head[:parts_at] + [7] * 50
    assert _common_length(head, prompt) == parts_at == _walked(head, prompt)
    assert _common_length(head, head[:parts_at]) == parts_at  # a prompt shorter than the head


def _walked(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_system_messages_that_differ_only_in_a_value_s_type_get_their_own_heads():
    key = system_heads._key
    one = [[{"role": "system", "content": "x", "n": 1}], None, {}]
    assert key("head", one) == key("head", [[{"n": 1, "content": "x", "role": "system"}], None, {}])
    others = ([[{"role": "system", "content": "x", "n": True}], None, {}],
              [[{"role": "system", "content": "x", "n": "1"}], None, {}],
              [[{"role": "system", "content": "x", "n": [1]}], None, {}],
              [[{"role": "system", "content": "x", "n": 1}], [], {}],
              [[{"role": "system", "content": "x", "n": 1}], None, {"n": 1}])
    assert len({key("head", p) for p in (one, *others)}) == 1 + len(others)


def test_a_head_shares_its_leading_ids_with_the_chats_cut_on_it(load_tiny):
    """A chat tokenized past the kept split starts with the same ids as its head (the snapshot point
    compares them per request), and the snapshot point is the one a fresh render gives."""
    _, tokenizer = load_tiny("llama")
    system_heads._splits.clear()
    first = messages(SYSTEM, "Question zero?")
    snapshot_at(tokenizer, first)
    later = messages(SYSTEM, "Question one: what now?")
    prompt = tokenize_chat(tokenizer, later, None, {})
    point = system_prefix_length(tokenizer, later, None, {}, prompt)
    [(_, head)] = system_heads._heads[tokenizer].values()
    [(_, split)] = system_heads._splits[tokenizer].values()
    cut = len(split.ids)
    assert cut > len(head) // 2 and any(i > 256 for i in head[:cut])  # ids past Python's cached small ints
    assert all(a is b for a, b in zip(head[:cut], prompt[:cut], strict=True))
    system_heads._heads.clear()
    system_heads._splits.clear()
    assert point == snapshot_at(tokenizer, later) == _walked(head, prompt)


def test_a_head_and_its_split_in_use_live_on_and_unused_ones_run_out(load_tiny, monkeypatch):
    """Agents resending a system prompt for longer than ``MAX_AGE_S`` keep its head and split (each
    chat they are found true of starts their age again); a whole age without such a chat renders anew."""
    _, tokenizer = load_tiny("llama")
    system_heads._splits.clear()
    now = [1000.0]
    monkeypatch.setattr(system_heads, "time", SimpleNamespace(monotonic=lambda: now[0]))

    def kept_now() -> tuple[object, object]:
        [(_, head)] = system_heads._heads[tokenizer].values()
        [(_, split)] = system_heads._splits[tokenizer].values()
        return head, split

    point = snapshot_at(tokenizer, messages(SYSTEM, "Question zero?"))
    head, split = kept_now()
    for i in range(4):  # a chat every 0.6 of the age: 2.4 ages in all
        now[0] += 0.6 * system_heads.MAX_AGE_S
        assert snapshot_at(tokenizer, messages(SYSTEM, f"Question {i}: what now?")) == point
        assert kept_now()[0] is head and kept_now()[1] is split
    now[0] += system_heads.MAX_AGE_S
    assert snapshot_at(tokenizer, messages(SYSTEM, "Question five?")) == point
    assert kept_now()[0] is not head and kept_now()[1] is not split  # ran out: found again
    system_heads._splits.clear()
