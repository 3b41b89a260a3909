"""Where a request's parse runs: a small body on the event loop, a large one in a worker thread."""

from __future__ import annotations

import asyncio
import threading

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
