"""The serial lane: one request at a time, token for token what mlx-lm generates.

It drives ``mlx_lm.generate.generate_step`` (the loop ``stream_generate``
and mlx_lm.server use): chunked prefill, ``async_eval`` of step n+1 before
reading token n, the same sampler and processors, the same ``clear_cache``
cadence. Reusing the loop rather than copying it is what makes parity hold
by construction; mlxq adds cancellation, stop strings and accounting around it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.grammar import GrammarState
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.output import EmitFn, RequestOutput
from mlxq.engine.sampling import make_request_processors, make_request_sampler
from mlxq.engine.types import FinishReason, Request
from mlxq.kv.capabilities import is_trimmable
from mlxq.kv.scheme import NATIVE, KvScheme
from mlxq.store.prefix import boundary_snapshot, finish_tokens, system_snapshot


class _Cancelled(Exception):
    """Raised from the prefill progress callback to abandon a prompt mid-prefill."""


def _prefill(model, caches, tokens: list[int], step: int, on_step, request: Request, scheme) -> None:
    """Feed ``tokens`` into ``caches`` in chunks, as mlx-lm's loop does, checking for cancellation."""
    with mx.stream(generation_stream):
        for at in range(0, len(tokens), step):
            model(mx.array(tokens[at : at + step])[None], cache=caches)
            scheme.convert(caches)  # where mlx-lm's loop quantizes: after the call, before the eval
            mx.eval([c.state for c in caches])
            mx.clear_cache()
            on_step()
            if request.cancelled.is_set():
                raise _Cancelled


def _with_prefix(processors: list, prefix: mx.array) -> list:
    """Processors that see ``prefix`` (the cached part of the prompt) before the tokens mlx-lm feeds them."""
    return [lambda tokens, logits, p=p: p(mx.concatenate([prefix, tokens]), logits) for p in processors]


def run_serial(
    model,
    tokenizer,
    request: Request,
    emit: EmitFn,
    *,
    prefill_step_size: int,
    on_step: Callable[[], None] = lambda: None,
    prompt_cache=None,
    scheme: KvScheme = NATIVE,
    grammar_timing: GrammarTiming | None = None,
) -> RequestOutput:
    """Generate ``request`` to completion (or cancellation), emitting its events.

    With a ``prompt_cache`` (store.PromptCache), the prefill starts after the
    longest cached prefix and the caches are stored again when the request
    ends. Logits processors (penalties) see the whole prompt either way:
    mlx-lm's loop only sees the tokens it prefills, so each processor is
    wrapped to see the cached prefix first (``_with_prefix``).
    """
    if request.params.seed is not None:
        mx.random.seed(request.params.seed)
    sampler = make_request_sampler(request.params, tokenizer)
    processors = make_request_processors(request.params)
    prompt = request.prompt_ids
    caches, cached = None, 0
    if prompt_cache is not None:
        caches, cached = prompt_cache.take(request.namespace, prompt)
    if caches is None:
        caches = make_prompt_cache(model)
    output = RequestOutput(request, tokenizer, emit, cached_tokens=cached)

    snapshot = prompt_cache is not None and not is_trimmable(caches)
    start = cached
    split = system_snapshot(len(prompt), request.snapshot_at, cached, trimmable=not snapshot)
    if split is not None:
        # Prefill up to the end of the shared system prompt first and snapshot it there:
        # other agents with the same system prompt start from this entry.
        try:
            _prefill(model, caches, prompt[cached:split], prefill_step_size, on_step, request, scheme)
        except _Cancelled:
            output.finish(FinishReason.CANCELLED)
            return output
        prompt_cache.put(request.namespace, prompt[:split], caches)
        start = split

    def on_prefill_progress(done: int, total: int) -> None:
        on_step()
        if request.cancelled.is_set():
            raise _Cancelled
        boundary = start + done
        if done and total - done == 1 and boundary == boundary_snapshot(len(prompt), trimmable=not snapshot):
            # All but the last prompt token are in: the state the next turn starts from.
            prompt_cache.put(request.namespace, prompt[:boundary], caches)

    if processors and start:
        processors = _with_prefix(processors, mx.array(prompt[:start]))
    if request.grammar is not None:  # last, as the batch lane applies it (Row.sample)
        processors = [*processors, GrammarState(request.grammar, tokenizer, grammar_timing).processor()]
    scheme.arm(caches)  # mlx-lm's own quantization hook converts them, per this scheme's layers
    steps = generate_step(
        mx.array(prompt[start:]),
        model,
        max_tokens=request.max_tokens,
        sampler=sampler,
        logits_processors=processors,
        prompt_cache=caches,
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=on_prefill_progress,
        kv_bits=scheme.hook_bits,
        kv_group_size=scheme.group_size,
        quantized_kv_start=0,
    )
    try:
        for token, logprobs in steps:
            on_step()
            if request.cancelled.is_set():
                output.finish(FinishReason.CANCELLED)
                break
            if output.add_token(token, logprobs):
                break
    except _Cancelled:
        output.finish(FinishReason.CANCELLED)
    finally:
        steps.close()
    stored = None if prompt_cache is None else finish_tokens(prompt + output.tokens, caches)
    if stored is not None:
        # The caches hold every token fed so far: the prompt, then the generated ones.
        prompt_cache.put(request.namespace, stored, caches)
    return output
