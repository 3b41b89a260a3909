"""A server that takes itself for Metal and whose Metal kernel does not build still shares, on plain operations.

The backend predicate (kv/metal_decode_kernel.on_metal) is injected into a
real server in this process; the kernel's start-up check then runs the real
``mx.fast.metal_kernel``, whose launch raises on a machine without Metal.
Agents on one system prompt still decode grouped, on the plain path, with
the outputs of a ``--batch 1`` server, and /stats says why the kernel is off.
"""

from __future__ import annotations

import httpx
import pytest

from mlxq.engine.engine import Engine, EngineConfig
from mlxq.kv import metal_decode_kernel, shared_prefix_decode
from mlxq.models.loader import load_model
from mlxq.server.config import ServerConfig
from mlxq.server.state import ServerState
from tests.conftest import InProcessServer
from tests.server.test_agents_prefix_tree import system_prompt
from tests.server.test_shared_prefix_agents import ask, shared_steps, wave

AGENTS = 4
MAX_TOKENS = 10


def server(model_dir, **engine) -> InProcessServer:
    return InProcessServer(ServerState(ServerConfig(), Engine(lambda: load_model(str(model_dir)),
                                                              EngineConfig(**engine))))


@pytest.mark.skipif(metal_decode_kernel.on_metal(), reason="the kernel builds here: its failure needs no Metal")
def test_a_metal_kernel_that_does_not_build_leaves_sharing_on_the_plain_path(tiny_model_dirs, load_tiny,
                                                                             monkeypatch):
    _, tokenizer = load_tiny("llama")
    system = system_prompt(tokenizer, 300)
    model_dir = tiny_model_dirs["llama"]
    with server(model_dir, max_rows=1) as serial:
        want = [ask(serial.url, system, agent, MAX_TOKENS) for agent in range(AGENTS)]
    for name, value in (("_kernels", frozenset()), ("_checked", False), ("_metal_checked", False), ("_declined", None)):
        monkeypatch.setattr(shared_prefix_decode, name, value)
    monkeypatch.delenv("MLXQ_METAL_ATTENTION", raising=False)
    monkeypatch.setattr(metal_decode_kernel, "on_metal", lambda: True)
    with server(model_dir, max_rows=AGENTS, shared_prefix_attention="on") as served:
        ask(served.url, system, 99, 2)  # the system prompt in the prompt cache before the wave
        got = wave(served.url, system, range(AGENTS), MAX_TOKENS)
        steps = shared_steps(served.url)
        stats = httpx.get(served.url + "/stats").json()["batch"]["shared_prefix"]
    assert got == want
    assert steps > 0 and stats["declined"] is None, stats  # sharing ran
    kernels = stats["kernels"]
    assert kernels["paths"] == [] and kernels["declined"].startswith("the Metal decode kernel did not run"), kernels
    assert "No Metal back-end" in kernels["declined"]
