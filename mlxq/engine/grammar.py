"""Grammar-constrained sampling: one llguidance matcher per request, its mask applied to the logits.

A request's ``GrammarSpec`` carries an llguidance grammar (built and
validated by the server). Each running request gets a ``GrammarState``;
before a token is drawn its logits go through ``constrain``, which sets every
token the grammar forbids to -inf; the token drawn becomes the next step's
input, and the matcher consumes it when the next mask is asked for. When the
grammar is complete only EOS is allowed, so the row ends as any row does.

Pipelining: the decode loop builds step n+1 before it reads token n. The
mask for step n+1 needs token n, so the forward is started first
(``async_eval`` of the logits: by the batch step, engine/step_sampling.py,
under the scheduler's fault handling, or by ``processor`` in the serial
lane), then token n is read (a sync the loop does anyway) and the mask is
computed on the host while the forward runs. In the batch lane every grammar
row's mask goes into one bitmask, applied in one op (engine/grammar_batch.py);
rows without a grammar never wait for it.
"""

from __future__ import annotations

import collections
import os
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


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` [k, V] with the tokens ``bitmask`` forbids at -inf: one upload and one masking op for
    all k rows. ``bitmask`` is llguidance's packed form [k, W] (int32 words, bit i of word w = token 32w+i)."""
    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


_templates: collections.OrderedDict = collections.OrderedDict()  # (tokenizer, grammar) -> unused matcher
TEMPLATES_KEPT = 64  # distinct grammars whose compiled form is kept (LRU)


def _fresh_matcher(llg_tok, grammar: str):
    """A matcher at the grammar's start. Requests repeating a schema (the common case: the same tools or
    response format on every turn) copy a kept one instead of compiling the grammar again."""
    import llguidance

    key = (id(llg_tok), grammar)
    with _lock:
        template = _templates.get(key)
        if template is None:
            template = _templates[key] = llguidance.LLMatcher(llg_tok, grammar)
            if len(_templates) > TEMPLATES_KEPT:
                _templates.popitem(last=False)
        _templates.move_to_end(key)
        return template.deep_copy()


class GrammarState:
    """One request's matcher. One mask per drawn token, in order: computed by ``prepare_masks`` (a
    decode step's grammar rows together, engine/grammar_batch.py) or by ``constrain`` alone, and
    applied to the logits by the batch step or by ``constrain``."""

    def __init__(self, spec: GrammarSpec, tokenizer, timing: GrammarTiming | None = None):
        self.spec = spec
        self._tokenizer = tokenizer
        self._timing = timing
        self._matcher = None  # built at the first draw, as wide as the model's logits
        self._input_is_drawn = False  # the next ``inputs`` is a token this state allowed, not the prompt's
        self._consumed = 0  # generated tokens the matcher has consumed
        self._prepared: np.ndarray | None = None  # the next draw's bitmask [1, W], when computed ahead

    def start(self, vocab_size: int) -> None:
        if self._matcher is None:
            self._matcher = _fresh_matcher(llg_tokenizer(self._tokenizer, vocab_size), self.spec.grammar)
            self._vocab_size = vocab_size

    @property
    def reads_input(self) -> bool:
        """The next mask needs the input token from the device (start the forward first)."""
        return self._input_is_drawn

    @property
    def live(self) -> bool:
        """More text can follow (else only EOS is allowed: the grammar is complete or the matcher broke)."""
        return not (self._matcher.is_error() or self._matcher.is_stopped())

    def catch_up(self, read_input) -> None:
        """Before computing a mask: consume the previous draw (``read_input()`` gives it)."""
        if self._input_is_drawn:
            self._consume([read_input()])
        self._input_is_drawn = True  # the token drawn under the coming mask is the next input

    def constrain(self, logits: mx.array, inputs: mx.array) -> mx.array:
        """``logits`` [1, V] for the token after ``inputs`` [1], with forbidden tokens at -inf."""
        if self._prepared is None:
            self.start(logits.shape[-1])
            self.catch_up(lambda: int(inputs.item()))
            started = time.perf_counter()
            self._prepared = _masks([self])
            if self._timing is not None:
                self._timing.add(time.perf_counter() - started)
        bitmask, self._prepared = self._prepared, None
        return apply_bitmask(logits, bitmask)

    def hold(self, bitmask: np.ndarray) -> None:
        """Keep this draw's mask [1, W], computed with the step's other rows, for ``constrain``."""
        self._prepared = bitmask

    def resume(self, generated: list[int]) -> None:
        """The row restarts from a prompt that ends with its ``generated`` tokens (KV recomputed after
        a preemption): consume the ones not consumed yet, or roll back one consumed but never handed
        out (the serial lane's loop feeds token n to the mask of draw n+1 before it yields token n);
        the next ``inputs`` is then a prompt token."""
        if self._matcher is not None:
            if self._consumed > len(generated):
                self._matcher.rollback(self._consumed - len(generated))
                self._consumed = len(generated)
            self._consume(generated[self._consumed :])
        self._input_is_drawn, self._prepared = False, None

    def _consume(self, tokens: list[int]) -> None:
        self._matcher.consume_tokens(tokens)
        self._consumed += len(tokens)

    def processor(self):
        """The same constraint as an mlx-lm logits processor ``(tokens, logits) -> logits`` (serial lane)."""
        def process(tokens: mx.array, logits: mx.array) -> mx.array:
            if self._input_is_drawn:
                mx.async_eval(logits)  # the forward runs while the host reads the token and builds the mask
            return self.constrain(logits, tokens[-1:])

        return process


_executor = None
# Several rows' masks go to llguidance's thread pool only on hosts with this many cores: on a 2-core
# host one after another on the engine thread was 2.5-5x faster (docs/benchmarks.md, "Structured
# outputs: constrained vs unconstrained decode"); many-core hosts are not measured yet.
PARALLEL_MASKS_MIN_CPUS = 8


def _masks(states: list[GrammarState]) -> np.ndarray:
    """Bitmasks [len(states), W] of the states' next draws (several live matchers on llguidance's threads
    when the host has the cores for it)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    global _executor
    bitmask = allocate_token_bitmask(len(states), states[0]._vocab_size)
    live = [(s._matcher, k) for k, s in enumerate(states) if s.live]
    if len(live) > 1 and (os.cpu_count() or 1) >= PARALLEL_MASKS_MIN_CPUS:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(_executor, live, bitmask)
    else:
        for matcher, k in live:
            fill_next_token_bitmask(matcher, bitmask, k)
    for k, state in enumerate(states):
        if not state.live:
            bitmask[k] = 0
            words = bitmask[k].view(np.uint32)
            for eos in state._tokenizer.eos_token_ids:
                words[eos // 32] |= np.uint32(1 << (eos % 32))
    return bitmask


def prepare_masks(rows: list[tuple[GrammarState, int]], inputs: mx.array, vocab_size: int,
                  timing: GrammarTiming | None) -> np.ndarray:
    """A decode step's grammar rows (state, index into ``inputs``): read the tokens drawn last step
    once, feed them to the matchers, and compute every mask into one bitmask [len(rows), W] while the
    already started forward runs."""
    states = [state for state, _ in rows]
    tokens = inputs.tolist() if any(s.reads_input for s in states) else []
    for state, i in rows:
        state.start(vocab_size)
        state.catch_up(lambda i=i: tokens[i])
    started = time.perf_counter()
    bitmask = _masks(states)
    if timing is not None:
        timing.add(time.perf_counter() - started, masks=len(states))
    return bitmask
