"""The RAM tier's byte count is the sum of what its nodes hold, through every change of the tree: puts that
split nodes, snapshots set and dropped, pins that split, eviction and demotion; for every kind of layer
(full attention, quantized, rings, recurrent state), and under a pipeline-parallel charge alike."""

from __future__ import annotations

import pytest

from mlxq.store.charge import measure_charge
from mlxq.store.prompt_cache import PromptCache
from tests.store.test_prefix_tree import PREFIX, prefilled, tail


def held_nodes(pc: PromptCache) -> list:
    out, todo = [], [tree.root for tree in pc._trees.values()]
    while todo:
        node = todo.pop()
        todo.extend(node.children.values())
        if node.parent is not None:
            out.append(node)
    return out


def counted(pc: PromptCache) -> int:
    """What the tree holds, node by node: the node's own bytes, or its charge."""
    if pc.charge is None:
        return sum(node.nbytes for node in held_nodes(pc))
    return sum(pc.charge.node(len(node.tokens), node.snapshot is not None) for node in held_nodes(pc))


@pytest.fixture(scope="module")
def rows(load_tiny):
    """(arch, quantized) -> agent -> its caches after the shared prefix and its tail less the last token
    (a prompt boundary); index -1: the shared prefix alone."""
    made: dict = {}

    def make(arch: str, quantized: bool) -> dict[int, list]:
        if (arch, quantized) not in made:
            model, _ = load_tiny(arch)
            prompts = {agent: PREFIX + tail(agent)[:-1] for agent in range(4)} | {-1: PREFIX}
            caches = {agent: prefilled(model, prompt) for agent, prompt in prompts.items()}
            made[arch, quantized] = {agent: [c.to_quantized(group_size=32, bits=8) for c in layers] if quantized
                                     else layers for agent, layers in caches.items()}
        return made[arch, quantized]

    return make


@pytest.mark.parametrize("charged", [False, True], ids=["own-bytes", "charge"])
@pytest.mark.parametrize(("arch", "quantized"), [("llama", False), ("llama", True), ("gemma3_text", False),
                                                 ("qwen3_next", False)])
def test_the_byte_count_is_the_nodes_sum_through_every_change(rows, arch, quantized, charged):
    made = rows(arch, quantized)
    pc = PromptCache(1 << 30, charge=measure_charge(made[0]) if charged else None)

    def check() -> None:
        assert pc.bytes == counted(pc) and (pc.bytes > 0) == (pc.nodes > 0)

    for agent in range(3):
        pc.put("", PREFIX + tail(agent)[:-1], made[agent])  # the second splits the first's node
        check()
    pc.put("", PREFIX, made[-1])  # a snapshot (or nothing new) at the split
    check()
    pin = pc.pin("", PREFIX + tail(1)[:5])  # splits agent 1's tail node
    check()
    pc.drop(("", tuple(PREFIX)))  # demoted with children below: only its snapshot goes
    check()
    pc.drop(("", tuple(PREFIX + tail(2)[:-1])))  # a leaf
    check()
    pc.max_bytes = pc.bytes  # the next put evicts what is not pinned
    pc.put("", PREFIX + tail(3)[:-1], made[3])
    check()
    assert pc.stats.evictions > 0
    pc.unpin(pin)
    check()
    pc.max_bytes = 0
    pc.unpin(pc.pin("", PREFIX + tail(3)[:-1]))  # evicts to the cap: everything
    check()
    assert (pc.bytes, pc.nodes, len(pc)) == (0, 0, 0)
