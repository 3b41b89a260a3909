"""Workloads: what each benchmark request sends. Seeded, so two servers get the same prompts.

Lengths are in words, because a client-only benchmark does not know the
server's tokenizer; the server's `usage` reports the real token counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources


def corpus_words() -> list[str]:
    text = resources.files("mlxq.models").joinpath("corpus.txt").read_text(encoding="utf-8")
    return sorted({w for w in text.split() if w.isascii() and w.isalpha()})


@dataclass
class Conversation:
    """A unit of work: one or more turns sent in order (a plain request is one turn)."""

    system: str | None  # shared system prompt, if any
    turns: list[str]  # user messages, sent one after another with the history
    tag: str = ""
    history: list[dict] = field(default_factory=list)  # filled while running (multi-turn)


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def make_workload(
    dataset: str,
    num_requests: int,
    prompt_len: int,
    *,
    seed: int = 0,
    num_groups: int = 4,
    question_len: int = 16,
    turns: int = 3,
    system_seed: int | None = None,
) -> list[Conversation]:
    """``system_seed``: draw the shared system prompts (shared-prefix, agents) from this seed instead
    of ``seed``, so workloads of different seeds share their prefixes and differ in their own text."""
    rng = random.Random(seed)
    system_rng = rng if system_seed is None else random.Random(system_seed)
    words = corpus_words()
    if dataset == "random":
        return [Conversation(None, [_text(rng, words, prompt_len)], "random") for _ in range(num_requests)]
    if dataset == "shared-prefix":
        systems = [f"Agent group {g}. " + _text(system_rng, words, prompt_len) for g in range(num_groups)]
        return [
            Conversation(systems[i % num_groups], [_text(rng, words, question_len)], f"group-{i % num_groups}")
            for i in range(num_requests)
        ]
    if dataset == "multi-turn":
        num_conversations = max(1, num_requests // turns)
        return [
            Conversation(None, [_text(rng, words, prompt_len if t == 0 else question_len) for t in range(turns)],
                         f"conv-{c}")
            for c in range(num_conversations)
        ]
    if dataset == "agents":
        # One person's agents: one long shared system prompt, many conversations of short turns.
        system = "You are one of several agents. " + _text(system_rng, words, prompt_len)
        return [
            Conversation(system, [_text(rng, words, question_len) for _ in range(turns)], f"agent-{c}")
            for c in range(max(1, num_requests // turns))
        ]
    raise ValueError(f"unknown dataset {dataset!r}: random, shared-prefix, multi-turn or agents")
