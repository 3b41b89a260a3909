"""One batch row's sampling state: its sampler, processors, token history and PRNG key.

Each row samples exactly as the serial lane would for the same request:
the same mlx-lm sampler and processors, applied to that row's [1, V] logits,
with processors seeing the same token history (prompt + tokens fed so far).
A seeded row carries its own PRNG key and draws with it explicitly
(sampling.make_keyed_sampler), so its draws follow the same key sequence as
``mx.random.seed(seed)`` followed by serial generation, whatever its
neighbours do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from mlxq.engine.grammar import GrammarState
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.output import RequestOutput
from mlxq.engine.sampling import make_keyed_sampler, make_request_processors, make_request_sampler
from mlxq.engine.types import Request


@dataclass
class Row:
    request: Request
    output: RequestOutput
    sampler: Callable[..., mx.array]  # logprobs [1, V] -> token [1]; keyed (logprobs, key) when key is set
    processors: list  # mlx-lm logits processors
    key: mx.array | None  # this row's PRNG state (seeded rows only)
    history: mx.array | None = None  # tokens the processors see; None when there are none
    grammar: GrammarState | None = None  # structured output: masks this row's logits before each draw
    checkpoint: object | None = None  # engine.checkpointing.RowCheckpoint when the request is checkpointed

    @property
    def is_plain_greedy(self) -> bool:
        """Sampling reduces to argmax over the row's logprobs: vectorizable across rows."""
        return (self.request.params.is_greedy and not self.processors and not self.request.logprobs
                and self.grammar is None)

    @property
    def awaiting_first(self) -> bool:
        """Running without a token handed out yet: it joined with its last prompt token pending."""
        return self.output.num_generated == 0 and self.output.finished is None

    def feed_history(self, tokens: mx.array) -> None:
        if self.processors:
            self.history = tokens if self.history is None else mx.concatenate([self.history, tokens])

    def sample(self, logits: mx.array, inputs: mx.array, masked: bool = False) -> tuple[mx.array, mx.array]:
        """(token [1], logprobs [1, V]) from this row's logits [1, V] after feeding ``inputs``;
        ``masked``: the grammar's mask is already applied (with the step's other grammar rows)."""
        if self.processors:
            self.feed_history(inputs)
            for processor in self.processors:
                logits = processor(self.history, logits)
        if self.grammar is not None and not masked:
            logits = self.grammar.constrain(logits, inputs)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self.key is None:
            return self.sampler(logprobs), logprobs
        self.key, draw = mx.random.split(self.key)
        return self.sampler(logprobs, draw), logprobs


def make_row(request: Request, tokenizer, emit, grammar_timing: GrammarTiming | None = None) -> Row:
    params = request.params
    grammar = None if request.grammar is None else GrammarState(request.grammar, tokenizer, grammar_timing)
    keyed = params.seed is not None and not params.is_greedy
    return Row(
        request=request,
        output=RequestOutput(request, tokenizer, emit),
        sampler=make_keyed_sampler(params) if keyed else make_request_sampler(params, tokenizer),
        processors=make_request_processors(request.params),
        key=mx.random.key(params.seed) if keyed else None,
        grammar=grammar,
    )


def resume_row(row: Row) -> Row:
    """A row whose KV was dropped, as a new joiner: the tokens it already emitted extend its prompt.

    Prefilling that sequence and feeding its last token continues the row where it
    stopped: its output (text, stop-string state, counts) and its PRNG key carry on,
    and its processors see the same history once the prefill has fed it again.
    """
    first = row.output.request  # as submitted; its max_tokens still ends the row (RequestOutput)
    request = replace(first, prompt_ids=first.prompt_ids + row.output.tokens,
                      max_tokens=max(1, first.max_tokens - row.output.num_generated))
    if row.grammar is not None:
        row.grammar.resume(row.output.tokens)  # its matcher continues from the tokens it emitted
    return replace(row, request=request, history=None)
