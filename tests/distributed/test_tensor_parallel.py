"""`mlxq serve --tensor-parallel 2` (and `--pipeline-parallel 2`) on the CPU, ring over loopback: the
same greedy tokens as one process, a lost rank failing its clients and the server, and ranks that
disagree refused."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxq.bench.servers import free_port
from mlxq.golden.cases import LONG
from mlxq.models.tiny import build_tiny_model
from tests.conftest import ServerProcess

REVERSED = " ".join(reversed(LONG.split()))
PROMPTS = ["The quick brown fox", "Once upon a time in a land", "1 2 3 4 5 6", "Tensor parallel serving is"]
SERVE = ("--log-level", "warning", "--warmup", "off")


@pytest.fixture(scope="module")
def shardable(tmp_path_factory) -> dict[str, Path]:
    """The "default" size: 4 heads and 2 KV heads, which split in two (the "tiny" size has one KV head);
    qwen3_next has no shard() in mlx-lm, only pipeline()."""
    root = tmp_path_factory.mktemp("tp-models")
    return {arch: build_tiny_model(arch, root / arch, preset="default") for arch in ("llama", "qwen3", "qwen3_next")}


@pytest.fixture(scope="module")
def uneven_pipeline(shardable, tmp_path_factory) -> Path:
    """qwen3_next without its last layer: 3 layers (linear, full attention, linear) split 2 + 1, so rank 0
    caches a recurrent state and KV, rank 1 a recurrent state only."""
    import mlx.core as mx

    out = tmp_path_factory.mktemp("pp-uneven") / "qwen3_next-3"
    shutil.copytree(shardable["qwen3_next"], out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v for k, v in weights.items() if not k.startswith("model.layers.3.")},
                        metadata={"format": "mlx"})
    return out


def _complete(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _run_c4(url: str) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: _complete(url, p), PROMPTS))


def _structured(url: str) -> str:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"messages": [{"role": "user", "content": "json please"}], "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("arch", "flags"), [("llama", ()), pytest.param("qwen3", ("--kv-quant", "8"),
                                                                         marks=pytest.mark.slow)])  # ~25 s
def test_two_ranks_generate_what_one_process_does(shardable, arch, flags):
    model = str(shardable[arch])
    with ServerProcess("--model", model, *flags, *SERVE) as one:
        alone = _run_c4(one.url)
        constrained = _structured(one.url)
    with ServerProcess("--model", model, *flags, "--tensor-parallel", "2", *SERVE) as two:
        sharded = _run_c4(two.url)
        assert _structured(two.url) == constrained
        solo = [_complete(two.url, p) for p in PROMPTS]  # each row alone, from the prompt cache on both ranks
        again = solo[0]
        cancelled = _leave_midway(two.url)
        after = _complete(two.url, PROMPTS[2])  # every rank dropped the cancelled row alike
        stats = httpx.get(f"{two.url}/stats", timeout=10).json()["distributed"]
    for a, b in zip(alone, sharded, strict=True):
        assert b["text"] == a["text"]
        assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
    gap = max(abs(x - y) for a, b in zip(alone, sharded, strict=True)
              for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True))
    print(f"{arch}: largest chosen-token logprob difference, 2 ranks vs 1 process: {gap:.3g}")
    # float32 KV: only the order of the all_sum's additions differs (measured up to 2.6e-6). 8-bit KV
    # rounds each value to one of 256 levels, and a value on a rounding boundary moves a level on
    # a last-bit difference in its input (measured 2.3e-4).
    assert gap < (1e-3 if "--kv-quant" in flags else 1e-4)
    assert [r["text"] for r in solo] == [a["text"] for a in alone]
    assert again["text"] == alone[0]["text"]
    assert stats["exchange_ms_per_iteration"] > 0
    assert cancelled == 1
    assert after["text"] == alone[2]["text"]
    assert stats["world_size"] == 2 and stats["backend"] == "ring"
    assert [r["rank"] for r in stats["ranks"]] == [0, 1]
    assert all(r["mlx_active_bytes"] > 0 for r in stats["ranks"])


def _cached_run(url: str, prompts: list[str]) -> list[tuple[str, int]]:
    """Each prompt alone, in order: (text, cached_tokens)."""
    out = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        out.append((response["choices"][0]["text"], response["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


@pytest.mark.slow  # two pipeline ranks and one process: about 22 s
def test_pipeline_ranks_generate_and_cache_what_one_process_does(uneven_pipeline):
    model = str(uneven_pipeline)
    with ServerProcess("--model", model, *SERVE) as one:
        alone = _run_c4(one.url)
        repeated_alone = _cached_run(one.url, [LONG, LONG, REVERSED])
    with ServerProcess("--model", model, "--pipeline-parallel", "2", *SERVE) as two:
        staged = _run_c4(two.url)
        repeated = _cached_run(two.url, [LONG, LONG])
        stats = httpx.get(f"{two.url}/stats", timeout=10).json()
    assert [b["logprobs"]["tokens"] for b in staged] == [a["logprobs"]["tokens"] for a in alone]
    assert stats["distributed"]["mode"] == "pipeline" and stats["prompt_cache"]["enabled"]
    assert repeated == repeated_alone[:2] and repeated[1][1] > 0
    # An entry of one of these prompts (~72 tokens) holds, on rank 0, a recurrent layer's state (71.7 kB) and
    # a full-attention layer's KV (1 kB per token); on rank 1, a recurrent layer's state alone. By their own
    # bytes, 200 kB would hold two entries on rank 1 but one on rank 0; counted alike, each new prompt
    # evicts the other on both ranks (else they would prefill from different places, and fail).
    with ServerProcess("--model", model, "--pipeline-parallel", "2", "--prompt-cache", "200KB", *SERVE) as two:
        evicting = _cached_run(two.url, [LONG, REVERSED, LONG, LONG])
        cache = httpx.get(f"{two.url}/stats", timeout=10).json()["prompt_cache"]
    texts = {LONG: repeated_alone[0][0], REVERSED: repeated_alone[2][0]}
    assert [text for text, _ in evicting] == [texts[p] for p in (LONG, REVERSED, LONG, LONG)]
    assert [cached for _, cached in evicting] == [0, 0, 0, repeated[1][1]]
    assert cache["evictions"] == 2 and cache["entries"] == 1


def _leave_midway(url: str) -> int:
    """Read a few tokens of a long stream, hang up; the engine's count of cancelled requests after."""
    body = {"prompt": "count", "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n >= 6:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        cancelled = httpx.get(f"{url}/stats", timeout=10).json()["engine"]["requests_cancelled"]
        if cancelled:
            return cancelled
        time.sleep(0.1)
    return 0


def _stream_until_cut(url: str, started: list) -> tuple[int, str]:
    """Tokens seen and the stream's error event, reading until the server ends it."""
    body = {"prompt": "count", "max_tokens": 5000, "temperature": 0, "stream": True, "ignore_eos": True}
    seen, error = 0, ""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        error = event["error"]["message"]
                    seen += 1
                    started.append(seen)
    except httpx.HTTPError as exc:
        error = f"transport error: {exc}"
    return seen, error


def test_killed_rank_fails_clients_and_the_server(shardable):
    server = ServerProcess("--model", str(shardable["llama"]), "--tensor-parallel", "2", "--stall-timeout", "20",
                           *SERVE)
    with server:
        rank1 = httpx.get(f"{server.url}/stats", timeout=10).json()["distributed"]["ranks"][1]["pid"]
        started: list = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream_until_cut, server.url, started)
            while len(started) < 3:
                time.sleep(0.05)
            os.kill(rank1, 9)
            killed_at = time.monotonic()
            reasons = []
            while server.proc.poll() is None and time.monotonic() - killed_at < 30:
                try:
                    health = httpx.get(f"{server.url}/health", timeout=2)
                    reasons.append((health.status_code, health.json()["reason"]))
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            seen, error = stream.result(timeout=30)
        code = server.proc.wait(timeout=30)
        exited_after = time.monotonic() - killed_at
        output = server.proc.stdout.read()
    assert code != 0
    assert exited_after < 20
    assert error, "the stream ended without an error"
    print(f"the client was told: {error}")
    assert seen < 5000
    assert any(status == 503 and "rank 1" in reason for status, reason in reasons), reasons
    assert f"rank 1 (pid {rank1}) exited with signal 9" in output


@pytest.mark.slow  # waits out the stall timeout: about 17 s
def test_a_hung_rank_ends_the_server_after_the_stall_timeout(shardable):
    server = ServerProcess("--model", str(shardable["llama"]), "--tensor-parallel", "2", "--stall-timeout", "4",
                           *SERVE)
    with server:
        rank1 = httpx.get(f"{server.url}/stats", timeout=10).json()["distributed"]["ranks"][1]["pid"]
        os.kill(rank1, signal.SIGSTOP)  # alive but not answering: every collective waits
        stopped_at = time.monotonic()
        try:
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
            code = server.proc.wait(timeout=60)
        finally:
            if server.proc.poll() is None:
                os.kill(rank1, signal.SIGKILL)
    assert response.status_code == 500
    assert "a rank is not answering" in response.json()["error"]["message"]
    assert code != 0
    assert time.monotonic() - stopped_at < 40  # 4 s of stall, 2 s for the errors, then the ranks are ended


def test_ranks_started_differently_are_refused(shardable, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    procs = []
    for rank, quant in ((0, "off"), (1, "8")):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(shardable["llama"]), "--port",
               str(free_port()), "--tensor-parallel", "2", "--kv-quant", quant, *SERVE]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode != 0 for proc in procs), outputs
    assert all("rank 1 was started differently from rank 0 (engine.kv_quant: rank 0 'off', rank 1 '8')" in out
               for out in outputs), outputs


@pytest.mark.slow  # mlx.launch starts the ranks: about 15 s
def test_under_mlx_launch_and_stopped_by_rank_0(shardable):
    """Ranks started by mlx.launch (its ring hostfile) serve as one; SIGTERM to rank 0 stops both."""
    port = free_port()
    launcher = Path(sys.executable).parent / "mlx.launch"
    cmd = [str(launcher), "--backend", "ring", "-n", "2", "--", sys.executable, "-m", "mlxq.cli.main", "serve",
           "--model", str(shardable["qwen3"]), "--port", str(port), "--tensor-parallel", "2", *SERVE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        from tests.conftest import wait_healthy

        wait_healthy(url, timeout=120, proc=proc)
        assert _complete(url, PROMPTS[1])["logprobs"]["tokens"]
        ranks = httpx.get(f"{url}/stats", timeout=10).json()["distributed"]["ranks"]
        os.kill(ranks[0]["pid"], 15)
        assert proc.wait(timeout=30) == 0  # both ranks ended cleanly (rank 0 told rank 1 to stop)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("settings", "message"), [
    ({"tensor_parallel": 2, "pipeline_parallel": 2}, "together are not available yet"),
    ({"pipeline_parallel": 2, "prompt_cache_bytes": 0, "kv_quant": "config"}, "--kv-quant config is not available"),
    ({"tensor_parallel": 0}, "--tensor-parallel and --pipeline-parallel must be >= 1"),
    ({"tensor_parallel": 2, "distributed_backend": "tcp"}, "--distributed-backend must be one of"),
])
def test_unsupported_combinations_are_refused(settings, message):
    from mlxq.server.config import ServerConfig

    with pytest.raises(ValueError, match=message):
        ServerConfig(**settings)


@pytest.mark.parametrize(("flags", "message"), [
    (("--pipeline-parallel", "2", "--checkpoint-interval", "64"), "not available with --pipeline-parallel"),
    (("--tensor-parallel", "2", "--checkpoint-interval", "64"), "generation checkpoints are not available with"),
])
def test_ssd_tier_settings_ranks_cannot_share_are_refused_at_the_command_line(tmp_path, flags, message):
    done = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--port", str(free_port()),
                           *flags, "--ssd-cache", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_taken_port_is_refused_before_ranks_start():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--tensor-parallel", "2", "--port",
                               str(port)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"port {port} is in use" in done.stderr


@pytest.mark.slow  # two servers drawing random weights, one of two ranks: about 25 s
def test_random_weights_drawn_on_each_rank_generate_what_one_process_does():
    """`--model random:PRESET` (no weights on disk): every rank draws the same weights and keeps its shard."""
    with ServerProcess("--model", "random:default", *SERVE) as one:
        alone = _run_c4(one.url)
    with ServerProcess("--model", "random:default", "--tensor-parallel", "2", *SERVE) as two:
        sharded = _run_c4(two.url)
    assert [b["logprobs"]["tokens"] for b in sharded] == [a["logprobs"]["tokens"] for a in alone]
