"""The serial lane leases its cached prefix as a batch row does: pinned while it runs, let go however it ends."""

from __future__ import annotations

from mlxq.engine.faults import Evaluator, FaultInjector
from mlxq.engine.serial import run_serial
from mlxq.engine.types import Request, SamplingParams
from mlxq.golden.cases import LONG
from mlxq.store.prompt_cache import PromptCache


def tree_pins(cache: PromptCache) -> int:
    """Pins held on every node of every tree."""
    total, stack = 0, [tree.root for tree in cache._trees.values()]
    while stack:
        node = stack.pop()
        total += node.pins
        stack.extend(node.children.values())
    return total


def test_the_serial_lane_pins_its_prefix_while_it_runs_and_lets_go_however_it_ends(load_tiny):
    model, tokenizer = load_tiny("llama")
    cache = PromptCache(1 << 30)
    shared = tokenizer.encode(LONG)
    run_serial(model, tokenizer, Request("first", shared + tokenizer.encode(" One?"), SamplingParams(), 4),
               lambda e: None, prefill_step_size=2048, prompt_cache=cache)
    assert tree_pins(cache) == 0

    def run(request: Request, evaluator: Evaluator | None = None, cancel_after: int | None = None):
        pins_seen = []

        def emit(event) -> None:
            pins_seen.append(tree_pins(cache))
            if cancel_after is not None and len(pins_seen) >= cancel_after:
                request.cancelled.set()

        output = run_serial(model, tokenizer, request, emit, prefill_step_size=2048, prompt_cache=cache,
                            evaluator=evaluator)
        return output, pins_seen

    plain, pins = run(Request("second", shared + tokenizer.encode(" Two?"), SamplingParams(), 6))
    assert plain.cached_tokens >= len(shared) and pins[0] == 1  # its prefix is held while it generates
    assert tree_pins(cache) == 0

    _, pins = run(Request("cancelled", shared + tokenizer.encode(" Three?"), SamplingParams(), 20), cancel_after=2)
    assert pins[0] == 1 and tree_pins(cache) == 0

    # A fault mid-decode: the attempt ends, a resumed one leases again, and both let go.
    faulted, pins = run(Request("faulted", shared + tokenizer.encode(" Two?"), SamplingParams(), 6),
                        Evaluator(FaultInjector({"decode": frozenset({3})})))
    assert faulted.tokens == plain.tokens and max(pins) == 1 and tree_pins(cache) == 0
