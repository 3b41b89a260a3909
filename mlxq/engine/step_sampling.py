"""A decode step's draws: every running row's next token from the step's logits.

All plain greedy rows: one vectorized argmax. Otherwise each row draws with
its own sampler (rows.py), from its own logits row. Grammar rows need the
token drawn last step before their masks exist, so with grammar rows the
step goes: draws of the rows without a grammar built, then the forward and
those draws started together (they never wait for a mask), token n read,
every mask computed on the host while the device runs, the grammar rows
masked in one op (grammar_batch.py), and their draws built last.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxq.engine.grammar_batch import constrain_step
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.rows import Row


def sample_step(rows: list[Row], logits: mx.array, inputs: mx.array, start: Callable[..., None],
                timing: GrammarTiming | None = None) -> tuple[mx.array, list]:
    """(tokens [B], per-row logprobs [V] or None) for ``logits`` [B, V] computed from ``inputs`` [B].
    ``start(*arrays)`` queues arrays for evaluation (the scheduler's fault-handled ``async_eval``)."""
    if all(row.is_plain_greedy for row in rows):
        # One vectorized argmax; per row the same math as the serial greedy sampler.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1), [None] * len(rows)  # no row asked for logprobs
    draws = {i: row.sample(logits[i : i + 1], inputs[i : i + 1]) for i, row in enumerate(rows)
             if row.grammar is None}
    grammar = [i for i, row in enumerate(rows) if row.grammar is not None]
    if grammar:
        start(logits, *(token for token, _ in draws.values()))
        step = constrain_step(rows, grammar, logits, inputs, timing)
        for i in grammar:
            row_logits, masked = step.row(i)
            draws[i] = rows[i].sample(row_logits, inputs[i : i + 1], masked=masked)
    tokens = mx.concatenate([draws[i][0] for i in range(len(rows))])
    return tokens, [draws[i][1].squeeze(0) for i in range(len(rows))]
