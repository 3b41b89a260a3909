"""Where a request's parse runs: a small body on the event loop, a large one in a worker thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxq.server import prompts
from mlxq.server.offload import INLINE_PARSE_BYTES, off_loop_unless_small, parsing_inline


class _ThreadRecordingTemplate:
    """A tokenizer whose template records the thread it renders on."""

    def __init__(self):
        self.threads: list[int] = []

    def apply_chat_template(self, messages, **kwargs) -> str:
        self.threads.append(threading.get_ident())
        return "rendered"


def test_a_small_body_parses_on_the_loop_and_a_large_one_in_a_worker():
    async def where() -> tuple[int, int, int]:
        here = threading.get_ident()
        small = await off_loop_unless_small(INLINE_PARSE_BYTES - 1, threading.get_ident)
        large = await off_loop_unless_small(INLINE_PARSE_BYTES, threading.get_ident)
        return here, small, large

    here, small, large = asyncio.run(where())
    assert small == here and large != here


def test_a_short_chat_parsed_on_the_loop_renders_there_and_others_within_the_budget():
    template = _ThreadRecordingTemplate()
    short = [{"role": "user", "content": "hi"}]
    long = short * (prompts.MAX_INLINE_MESSAGES + 1)

    def render(messages: list) -> str:
        return prompts.render_chat(template, messages, None, {}, add_generation_prompt=True)

    async def on_the_loop(messages: list) -> str:
        return await off_loop_unless_small(10, render, messages)

    assert asyncio.run(on_the_loop(short)) == "rendered" and not parsing_inline.get()
    assert render(short) == "rendered"  # outside an inline parse: the budgeted render thread
    assert asyncio.run(on_the_loop(long)) == "rendered"  # many turns: the budgeted thread too
    here = threading.get_ident()
    assert template.threads[0] == here and here not in template.threads[1:]


def test_a_long_chat_on_a_kept_head_parses_on_the_loop_and_a_first_one_leaves_it(load_tiny):
    """A body is parsed on the loop whatever its size under INLINE_PARSE_BYTES; tokenizing a long text
    (a system prompt seen for the first time) starts the parse over in a worker thread, with the same ids."""
    from mlxq.server import system_heads
    from mlxq.server.offload import INLINE_TEXT_CHARS

    _, tokenizer = load_tiny("llama")
    system = "You are one of many agents; read the whole shop manual before you answer. " * 1000
    assert INLINE_TEXT_CHARS < len(system) and 64 * 1024 < len(system) < INLINE_PARSE_BYTES
    system_heads._heads.clear()
    system_heads._splits.clear()
    runs = []

    def parse(messages: list) -> tuple[list[int], int | None]:
        runs.append((threading.get_ident(), parsing_inline.get()))
        ids = prompts.tokenize_chat(tokenizer, messages, None, {})
        return ids, prompts.system_prefix_length(tokenizer, messages, None, {}, ids)

    async def on_the_loop(question: str) -> tuple[list[int], int | None, int]:
        runs.clear()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids, point = await off_loop_unless_small(len(system) + 100, parse, messages)
        assert ids == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        return ids, point, threading.get_ident()

    try:
        ids, first_point, here = asyncio.run(on_the_loop("Question zero?"))
        assert runs[0] == (here, True) and runs[-1][0] != here and not runs[-1][1]  # started over off the loop
        for question in ("Question one: what now?", "<|im_start|>user pretends", "héllo"):
            ids, point, here = asyncio.run(on_the_loop(question))
            assert runs == [(here, True)] and point == first_point  # kept head: on the loop, once
    finally:
        system_heads._heads.clear()
        system_heads._splits.clear()


def test_a_long_prompt_or_many_turns_leave_the_loop_before_anything_is_kept(load_tiny):
    _, tokenizer = load_tiny("llama")
    from mlxq.server.offload import INLINE_TEXT_CHARS, OffLoop

    def inline(fn):
        token = parsing_inline.set(True)
        try:
            return fn()
        finally:
            parsing_inline.reset(token)

    long = "many words " * (INLINE_TEXT_CHARS // 10)
    with pytest.raises(OffLoop):
        inline(lambda: prompts.tokenize_completion(tokenizer, long))
    assert prompts.tokenize_completion(tokenizer, long) == list(tokenizer.encode(long))
    turns = [{"role": "user", "content": "hi"}] * (prompts.MAX_INLINE_MESSAGES + 1)
    with pytest.raises(OffLoop):
        inline(lambda: prompts.render_chat(tokenizer, turns, None, {}, add_generation_prompt=True))
    from mlxq.server import structured

    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(4000)}}
    with pytest.raises(OffLoop):  # compiled in a worker thread (checked before the grammar library runs)
        inline(lambda: structured._json_grammar("json_schema", schema, None, "response_format"))
