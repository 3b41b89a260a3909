"""Grammar-constrained sampling: one llguidance matcher per request, its mask applied to the logits.

A request's ``GrammarSpec`` carries an llguidance grammar (built and
validated by the server). Each running request gets a ``GrammarState``;
before a token is drawn its logits go through ``constrain``, which sets every
token the grammar forbids to -inf; the token drawn becomes the next step's
input, and the matcher consumes it when the next mask is asked for. When the
grammar is complete only EOS is allowed, so the row ends as any row does.

Pipelining: the decode loop builds step n+1 before it reads token n. The
mask for step n+1 needs token n, so ``constrain`` first starts the forward
(``async_eval`` of the logits), then reads token n (a sync the loop does
anyway), then computes the mask on the host while the forward runs. Rows
without a grammar never wait for it: the mask only gates this row's draw.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.types import GrammarSpec

_tokenizers: dict[int, object] = {}
_lock = threading.Lock()


def llg_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of an mlx-lm tokenizer, ``vocab_size`` wide (the model's logits), built once."""
    import llguidance.hf

    key = (id(tokenizer), vocab_size)
    with _lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(
                tokenizer._tokenizer, n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
        return _tokenizers[key]


def _unpack(bitmask: np.ndarray, vocab_size: int) -> mx.array:
    """llguidance's packed bitmask (int32 words, bit i of word w = token 32w+i) -> bool [1, V]."""
    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(mx.bool_)


class GrammarState:
    """One request's matcher. ``constrain`` is called once per drawn token, in order."""

    def __init__(self, spec: GrammarSpec, tokenizer, timing: GrammarTiming | None = None):
        self.spec = spec
        self._tokenizer = tokenizer
        self._timing = timing
        self._matcher = None  # built at the first draw, as wide as the model's logits
        self._input_is_drawn = False  # the next ``inputs`` is a token this state allowed, not the prompt's
        self._consumed = 0  # drawn tokens the matcher has consumed

    def _start(self, vocab_size: int) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(llg_tokenizer(self._tokenizer, vocab_size), self.spec.grammar)
        self._eos = sorted(self._tokenizer.eos_token_ids)
        self._vocab_size = vocab_size
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def constrain(self, logits: mx.array, inputs: mx.array) -> mx.array:
        """``logits`` [1, V] for the token after ``inputs`` [1], with forbidden tokens at -inf."""
        if self._matcher is None:
            self._start(logits.shape[-1])
        if self._input_is_drawn:
            mx.async_eval(logits)  # the forward runs while the host reads the token and builds the mask
            self._matcher.consume_token(int(inputs.item()))
            self._consumed += 1
        self._input_is_drawn = True
        start = time.perf_counter()
        allowed = self._allowed()
        if self._timing is not None:
            self._timing.add(time.perf_counter() - start)
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def resume(self, emitted: int) -> None:
        """Continue after ``emitted`` tokens were handed out, the next draw's input being the last of them.

        A row recomputed after a preemption feeds its last emitted token again; the step
        that failed may already have consumed it, so the matcher goes back to the tokens
        before it (llguidance rolls back token by token)."""
        target = max(0, emitted - 1)
        if self._matcher is not None and self._consumed > target:
            self._matcher.rollback(self._consumed - target)
            self._consumed = target
        self._input_is_drawn = emitted > 0

    def _allowed(self) -> mx.array:
        from llguidance.numpy import fill_next_token_bitmask

        if self._matcher.is_error() or self._matcher.is_stopped():
            # Nothing more can follow (or the matcher broke): end the row.
            allowed = np.zeros(self._vocab_size, dtype=bool)
            allowed[self._eos] = True
            return mx.array(allowed)[None]
        fill_next_token_bitmask(self._matcher, self._bitmask)
        return _unpack(self._bitmask, self._vocab_size)

    def processor(self):
        """The same constraint as an mlx-lm logits processor ``(tokens, logits) -> logits`` (serial lane)."""
        return lambda tokens, logits: self.constrain(logits, tokens[-1:])
