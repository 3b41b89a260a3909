"""Start-up warm-up (engine/warmup.py): every generation path runs before the server is
ready, and leaves no trace a user could see — no counted request, no prompt-cache entry —
and no difference in what the first real request generates."""

from __future__ import annotations

import httpx
import pytest

from mlxq.engine.engine import Engine, EngineConfig
from mlxq.engine.types import Request, SamplingParams
from mlxq.models.loader import load_model
from tests.conftest import ServerProcess
from tests.engine.test_engine_thread import run


def _engine(model_dir, **config) -> Engine:
    engine = Engine(lambda: load_model(str(model_dir)), EngineConfig(**config))
    engine.start()
    assert engine.ready.wait(120)
    return engine


@pytest.mark.parametrize("arch,batch,kv_quant", [("llama", 4, "off"), ("llama", 1, "off"), ("llama", 4, "8"),
                                                 ("gemma3_text", 4, "off"), ("qwen3_next", 4, "off")])
def test_warmup_leaves_no_trace_and_changes_no_output(tiny_model_dirs, arch, batch, kv_quant):
    request = lambda: Request("r", list(range(5, 45)), SamplingParams(), 12)  # noqa: E731
    cold = _engine(tiny_model_dirs[arch], max_rows=batch, kv_quant=kv_quant)
    try:
        want = [e.token_id for e in run(cold, request()) if e.token_id is not None]
        assert cold.warmup_done is False
    finally:
        cold.stop()
    warm = _engine(tiny_model_dirs[arch], max_rows=batch, kv_quant=kv_quant, warmup="on")
    try:
        assert warm.warmup_done is True
        assert warm.stats.requests_finished == 0 and warm.stats.generated_tokens == 0
        assert warm.prompt_cache is None or len(warm.prompt_cache) == 0
        got = [e.token_id for e in run(warm, request()) if e.token_id is not None]
        assert got == want
    finally:
        warm.stop()


def test_warmup_flag_reaches_a_real_server(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--warmup", "on", "--log-level", "warning") as server:
        stats = httpx.get(f"{server.url}/stats").json()
        assert stats["engine"]["warmed_up"] is True
        assert stats["engine"]["requests_finished"] == 0
        assert stats["prompt_cache"]["entries"] == 0
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_bad_warmup_value_is_a_usage_error(tiny_model_dirs):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(tiny_model_dirs["llama"]),
                           "--warmup", "sometimes"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--warmup must be auto, on or off" in proc.stderr


def _counting(monkeypatch, names: tuple[str, ...]) -> dict[str, int]:
    from mlxq.engine.running_batch import RunningBatch

    calls: dict[str, int] = {}

    def counting(name: str):
        real = getattr(RunningBatch, name)

        def counted(self, *args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(self, *args, **kwargs)
        return counted

    for name in names:
        monkeypatch.setattr(RunningBatch, name, counting(name))
    return calls


def test_shared_warmup_runs_each_shared_prefix_path_once(load_tiny, monkeypatch):
    """engine/warmup_shared.py as a GPU server runs it (token 0 in the decode step): tails prefilled
    on the stored prefix into an empty batch and appended to a running group, rows grouped after an
    ordinary join, all on a prompt cache of its own; the routing is off again after it."""
    from mlxq.engine.prefix_sharing import SharingPolicy
    from mlxq.engine.scheduler import BatchScheduler, SchedulerConfig
    from mlxq.engine.warmup_shared import shares, warm_shared
    from mlxq.kv import attention_route
    from mlxq.kv.projection import measure_footprint
    from mlxq.kv.sharing_plan import plan_sharing
    from mlxq.store.prompt_cache import PromptCache

    model, tokenizer = load_tiny("llama")
    serving = BatchScheduler(model, tokenizer, measure_footprint(model),
                             SchedulerConfig(32, 4, 2048, None, token0_in_decode=True),
                             prompt_cache=PromptCache(1 << 28), sharing=SharingPolicy("auto", plan_sharing(model)))
    assert shares(serving)
    calls = _counting(monkeypatch, ("share", "adopt_grouped", "join_shared"))
    try:
        warm_shared(model, tokenizer, serving, list(range(10, 70)))
        assert calls == {"share": 1, "adopt_grouped": 1, "join_shared": 1}, calls
        assert attention_route._routing is False
        assert len(serving.prompt_cache) == 0 and serving.is_idle
    finally:
        attention_route.uninstall()


def test_warmup_with_shared_prefixes_leaves_no_trace(tiny_model_dirs, monkeypatch):
    """A server with ``--shared-prefix-attention on`` warms those paths too, and what it warms
    leaves nothing behind: no request counted, the prompt cache empty, the same output."""
    from mlxq.kv import attention_route

    request = lambda: Request("r", list(range(5, 45)), SamplingParams(), 12)  # noqa: E731
    config = dict(max_rows=4, shared_prefix_attention="on", prompt_cache_bytes=1 << 28)
    cold = _engine(tiny_model_dirs["llama"], **config)
    try:
        want = [e.token_id for e in run(cold, request()) if e.token_id is not None]
    finally:
        cold.stop()
    calls = _counting(monkeypatch, ("share",))
    warm = _engine(tiny_model_dirs["llama"], warmup="on", **config)
    try:
        assert warm.warmup_done is True and calls.get("share", 0) >= 1  # rows were grouped
        assert len(warm.prompt_cache) == 0 and warm.stats.requests_finished == 0
        got = [e.token_id for e in run(warm, request()) if e.token_id is not None]
        assert got == want
    finally:
        warm.stop()
        attention_route.uninstall()
