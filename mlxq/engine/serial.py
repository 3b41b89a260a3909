"""The serial lane: one request at a time, token for token what mlx-lm generates.

It drives ``mlx_lm.generate.generate_step`` (the loop ``stream_generate``
and mlx_lm.server use): chunked prefill, ``async_eval`` of step n+1 before
reading token n, the same sampler and processors, the same ``clear_cache``
cadence. Reusing the loop rather than copying it is what makes parity hold
by construction; mlxq adds cancellation, stop strings and accounting around it.

An allocation failure ends mlx-lm's loop; the request then resumes from its
tokens in a new one (engine/serial_resume.py), or is requeued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.checkpointing import Checkpointing, restore_serial
from mlxq.engine.faults import Evaluator, is_allocation_failure, release_cached_memory
from mlxq.engine.grammar import GrammarState
from mlxq.engine.grammar_timing import GrammarTiming
from mlxq.engine.output import EmitFn, RequestOutput
from mlxq.engine.preempt import MAX_PREEMPTIONS
from mlxq.engine.sampling import make_request_processors, make_request_sampler
from mlxq.engine.serial_resume import DrawLedger, SerialPreempted, SerialRun
from mlxq.engine.types import FinishReason, Request
from mlxq.kv.capabilities import is_trimmable
from mlxq.kv.scheme import NATIVE, KvScheme
from mlxq.store.lease import Lease
from mlxq.store.prefix import boundary_snapshot, finish_tokens, system_snapshot

log = logging.getLogger("mlxq.serial")


class _Cancelled(Exception):
    """Raised from the prefill progress callback to abandon a prompt mid-prefill."""


def _prefill(model, caches, tokens: list[int], step: int, on_step, request: Request, scheme, check) -> None:
    """Feed ``tokens`` into ``caches`` in chunks, as mlx-lm's loop does, checking for cancellation."""
    with mx.stream(generation_stream):
        for at in range(0, len(tokens), step):
            model(mx.array(tokens[at : at + step])[None], cache=caches)
            scheme.convert(caches)  # where mlx-lm's loop quantizes: after the call, before the eval
            check("prefill")
            mx.eval([c.state for c in caches])
            mx.clear_cache()
            on_step()
            if request.cancelled.is_set():
                raise _Cancelled


def _with_prefix(processors: list, prefix: mx.array) -> list:
    """Processors that see ``prefix`` (the cached part of the prompt) before the tokens mlx-lm feeds them."""
    return [lambda tokens, logits, p=p: p(mx.concatenate([prefix, tokens]), logits) for p in processors]


def start_run(request: Request, tokenizer, emit: EmitFn, grammar_timing: GrammarTiming | None = None) -> SerialRun:
    """A request's serial state before its first attempt (seeds MLX's global key, as mlx_lm.server does)."""
    params = request.params
    if params.seed is not None:
        mx.random.seed(params.seed)
    draws = None
    if params.seed is not None and not params.is_greedy:
        draws = DrawLedger(params.seed, per_draw=2 if params.xtc_probability > 0 else 1)
    grammar = None if request.grammar is None else GrammarState(request.grammar, tokenizer, grammar_timing)
    return SerialRun(request, RequestOutput(request, tokenizer, emit), make_request_sampler(params, tokenizer),
                     make_request_processors(params), grammar, draws)


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
    evaluator: Evaluator | None = None,
    resume: SerialRun | None = None,
    checkpoints: Checkpointing | None = None,
) -> RequestOutput:
    """Generate ``request`` to completion (or cancellation), emitting its events.

    ``resume``: a run requeued after a memory fault (SerialPreempted carries it), continued
    where it stopped. A fault is retried once at once; when the retry fails too before a
    token is handed out, SerialPreempted is raised for the engine to requeue the run.
    ``checkpoints``: publish the run's state every interval, and resume it from its checkpoint
    when one is on disk (engine/checkpointing.py).
    """
    evaluator = evaluator or Evaluator()
    run = resume or start_run(request, tokenizer, emit, grammar_timing)
    if resume is None and checkpoints is not None:
        run.restored = restore_serial(run, checkpoints)
        if run.output.finished is not None:
            return run.output
    while True:
        try:
            if run.retrying:
                run.restore()
            _attempt(model, run, evaluator, prefill_step_size, on_step, prompt_cache, scheme)
            return run.output
        except Exception as exc:
            if not is_allocation_failure(exc):
                raise
            if not _after_fault(run, evaluator, exc):
                return run.output


def _after_fault(run: SerialRun, evaluator: Evaluator, exc: Exception) -> bool:
    """Release memory; True: resume at once. Requeue (SerialPreempted), or False: failed, requeued too often."""
    counters = evaluator.counters
    counters.memory_faults += 1
    release_cached_memory()
    run.prepare_resume()
    if not run.retrying:
        log.warning("request %s: allocation failed (%s); releasing cached memory and resuming from its %d "
                    "tokens", run.request.request_id, exc, len(run.sequence))
        run.retrying = True
        return True
    if run.requeue():
        counters.preemptions += 1
        log.warning("request %s: out of memory again (%s); requeued (%d)", run.request.request_id, exc,
                    run.times_requeued)
        raise SerialPreempted(run) from exc
    counters.failed_out_of_memory += 1
    run.output.finish(FinishReason.ERROR, error=f"out of memory after {MAX_PREEMPTIONS} requeues: {exc}")
    return False


def _attempt(model, run: SerialRun, evaluator: Evaluator, step: int, on_step, prompt_cache, scheme) -> None:
    """One mlx-lm loop over the run's sequence (prompt + tokens handed out), until the request ends.

    With a ``prompt_cache`` (store.PromptCache), the prefill starts after the longest cached
    prefix, leased as a batch row leases it: the node chain it came from stays pinned (never
    evicted under this request) until the attempt ends, however it ends.
    """
    request = run.request
    # A checkpoint brings its own caches: nothing is taken from the prompt cache then.
    take = prompt_cache is not None and run.restored is None
    lease = prompt_cache.lease(request.namespace, run.sequence) if take else Lease(0, None)
    try:
        _attempt_on(model, run, evaluator, step, on_step, prompt_cache, scheme, lease)
    finally:
        lease.release()


def _attempt_on(model, run: SerialRun, evaluator: Evaluator, step: int, on_step, prompt_cache, scheme,
                lease: Lease) -> None:
    """The attempt on the leased prefix; the caches are stored again when the request ends.

    Logits processors (penalties) see the whole sequence: mlx-lm's loop only sees the tokens
    it prefills, so each processor is wrapped to see the cached prefix first (``_with_prefix``).
    """
    request, output, prompt = run.request, run.output, run.sequence
    if run.restored is not None:  # a checkpoint's caches: every token but the pending one (the last)
        caches, cached, run.restored = run.restored, len(prompt) - 1, None
    else:
        caches, cached = lease.caches, lease.cached
    caches = caches if caches is not None else make_prompt_cache(model)
    if not run.retrying and not output.checkpoint_tokens:
        output.cached_tokens = cached  # a resumed run keeps what the client's prompt found
    check = evaluator.injector.check
    snapshot_boundary = None if prompt_cache is None else boundary_snapshot(
        len(prompt), is_trimmable(caches), shared=request.snapshot_at is not None)
    try:
        start = _to_snapshot(model, caches, cached, prompt, request, prompt_cache, step, on_step, scheme, check)
    except _Cancelled:
        output.finish(FinishReason.CANCELLED)
        return

    def on_prefill_progress(done: int, total: int) -> None:
        on_step()
        if request.cancelled.is_set():
            raise _Cancelled
        if 0 < done < total:
            check("prefill")
        boundary = start + done
        if snapshot_boundary and done and total - done == 1 and boundary == snapshot_boundary:
            # All but the last prompt token are in: the state the next turn starts from.
            prompt_cache.put(request.namespace, prompt[:boundary], caches)

    steps = _generate(model, run, check, prompt, start, caches, step, on_prefill_progress, scheme)
    _hand_out(run, steps, evaluator, on_step, caches)
    stored = None if prompt_cache is None else finish_tokens(request.prompt_ids + output.tokens, caches)
    if stored is not None:
        # The caches hold every token fed so far: the sequence, then the generated ones.
        prompt_cache.put(request.namespace, stored, caches)


def _to_snapshot(model, caches, cached: int, prompt: list[int], request: Request, prompt_cache, step: int,
                 on_step, scheme, check) -> int:
    """Where mlx-lm's loop starts: after the cached prefix, or after the shared system prompt.

    Caches that cannot be trimmed (sliding windows, recurrent state) are stored only where
    they stand: prefill up to the end of the system prompt first and snapshot it there, so
    other agents with the same system prompt start from this entry."""
    if prompt_cache is None:
        return cached
    split = system_snapshot(len(prompt), request.snapshot_at, cached, is_trimmable(caches))
    if split is None:
        return cached
    _prefill(model, caches, prompt[cached:split], step, on_step, request, scheme, check)
    prompt_cache.put(request.namespace, prompt[:split], caches)
    return split


def _generate(model, run: SerialRun, check, prompt: list[int], start: int, caches, step: int, on_progress,
              scheme):
    """mlx-lm's generator from ``prompt[start:]`` on ``caches``, with the run's sampler and processors."""
    processors = run.processors
    if processors and start:
        processors = _with_prefix(processors, mx.array(prompt[:start]))
    if run.grammar is not None:  # last, as the batch lane applies it (Row.sample)
        processors = [*processors, run.grammar.processor()]
    first = run.output.num_generated  # the index of this loop's first draw
    drawn = 0

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal drawn
        check("token0" if drawn == 0 else "decode")
        if run.draws is not None:
            run.draws.before_draw(first + drawn)
        drawn += 1
        run.last_draw = run.sampler(logprobs)  # the pending token when the one before is handed out
        return run.last_draw

    scheme.arm(caches)  # mlx-lm's own quantization hook converts them, per this scheme's layers
    return generate_step(
        mx.array(prompt[start:]), model, max_tokens=run.request.max_tokens - first, sampler=sampler,
        logits_processors=processors, prompt_cache=caches, prefill_step_size=step,
        prompt_progress_callback=on_progress, kv_bits=scheme.hook_bits, kv_group_size=scheme.group_size,
        quantized_kv_start=0,
    )


def _hand_out(run: SerialRun, steps, evaluator: Evaluator, on_step, caches) -> None:
    """Tokens from mlx-lm's loop to the request's output until it ends (or is cancelled)."""
    request, output = run.request, run.output
    try:
        for token, logprobs in steps:
            on_step()
            if request.cancelled.is_set():
                if run.checkpoint is not None:
                    run.checkpoint.at_serial_cancel(run, token, caches)
                output.finish(FinishReason.CANCELLED)
                break
            if run.retrying:  # the resumed loop got as far as a new token: the retry worked
                run.retrying = False
                evaluator.counters.retried_ok += 1
            finished = output.add_token(token, logprobs)
            if run.draws is not None:
                run.draws.handed_out(output.num_generated)
            if finished:
                break
            if run.checkpoint is not None:
                run.checkpoint.after_serial_token(run, caches)
    except _Cancelled:
        output.finish(FinishReason.CANCELLED)
    finally:
        steps.close()
