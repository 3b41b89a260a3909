"""Generation checkpoints through real servers: kill -9 and SIGTERM mid-generation, then the same request."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app
from tests.conftest import ServerProcess

PROMPT = "Write a very long story about a lighthouse keeper and the sea."
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
MAX_TOKENS = 800  # long enough that a flush after INTERRUPT_AT tokens lands mid-generation on a busy CPU
INTERRUPT_AT = 200
INTERVAL = 16


def body(sampling: dict, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **sampling}


def complete(url: str, payload: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def serve(model, cache, *extra: str, limit_file_bytes: int | None = None) -> ServerProcess:
    args = ("--model", str(model), "--batch", "1", "--ssd-cache", str(cache), "--checkpoint-interval",
            str(INTERVAL), "--log-level", "warning", *extra)
    env = {"MLXQ_SSE_COALESCE": "0"}  # one chunk per token: the client counts where the generation is
    if limit_file_bytes is None:
        return ServerProcess(*args, env=env)
    # Through `ulimit -f` (KiB): files beyond it fail to grow as on a full disk (Python ignores SIGXFSZ).
    ulimit = f'ulimit -f {limit_file_bytes // 1024}; exec "$@"'
    return ServerProcess(*args, env=env, wrap=("bash", "-c", ulimit, "serve"))


def stream_until(url: str, payload: dict, tokens: int, *, leave: bool = False) -> threading.Event:
    """Stream ``payload`` in a thread; the event is set once ``tokens`` chunks have arrived (``leave``: and
    the client disconnects there)."""
    reached = threading.Event()

    def run() -> None:
        seen = 0
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**payload, "stream": True},
                              timeout=300) as r:
                for line in r.iter_lines():
                    seen += line.startswith("data: {")
                    if seen >= tokens:
                        reached.set()
                        if leave:
                            break
        except httpx.HTTPError:
            pass  # the server goes away under it
        reached.set()

    threading.Thread(target=run, daemon=True).start()
    return reached


def cli(*args: str):
    """`mlxq ...` in this process (typer's runner): ``.stdout``, ``.exit_code``."""
    return CliRunner().invoke(app, list(args))


def flush(url: str) -> dict:
    r = httpx.post(url + "/admin/cache/flush", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


SHUTDOWN_LINE = re.compile(r"SSD cache durable at shutdown: \d+ entries, longest prefix \d+ tokens"
                           r"(?:, (\d+) generation checkpoints)?")


def shutdown_checkpoints(log: str) -> int | None:
    """How many requests' checkpoints the shutdown's flush reported durable (its log line; None: no such
    line, as when the flush was not durable)."""
    found = SHUTDOWN_LINE.findall(log)
    return int(found[-1] or 0) if found else None


def interrupt(model, cache, payload: dict, how: str, *extra: str, reference: bool = True
              ) -> tuple[str | None, dict, str]:
    """The uninterrupted text of ``payload`` (``reference``); then ``payload`` again, run past INTERRUPT_AT
    tokens, a flush, and the server stopped under it (kill -9 or SIGTERM): (text, the flush's result, the
    server's log: at info level, so a SIGTERM's shutdown line is in it).

    On a loaded host the generation can end before the flush lands, leaving nothing to resume (completion
    removes the checkpoint): such a run says nothing about resuming and is run again, up to three times."""
    text = None
    for _ in range(3):
        with serve(model, cache, "--shutdown-timeout", "0.2", *extra, "--log-level", "info") as server:
            if reference and text is None:
                text = complete(server.url, payload)["choices"][0]["text"]  # completion removes its checkpoint
            assert stream_until(server.url, payload, INTERRUPT_AT).wait(120)
            flushed = flush(server.url)
            server.proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
            server.proc.wait(60)
            log = server.proc.stdout.read()
        if flushed["checkpoints"]["requests"]:
            break
    return text, flushed, log


# The cross's other architectures restart servers for 15-45 s each on two cores: in the slow set.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("arch, sampling, how, kv_quant", [
    ("llama", GREEDY, "kill", "off"), pytest.param("llama", SEEDED, "term", "off", marks=SLOW),
    pytest.param("gemma3_text", SEEDED, "kill", "off", marks=SLOW),
    pytest.param("gemma3_text", GREEDY, "term", "off", marks=SLOW),
    pytest.param("qwen3_next", SEEDED, "term", "off", marks=SLOW),
    pytest.param("qwen3_next", GREEDY, "kill", "off", marks=SLOW),
    pytest.param("gemma3_text", SEEDED, "kill", "8", marks=SLOW),
])
def test_an_interrupted_generation_resumes_to_the_uninterrupted_text(tiny_model_dirs, tmp_path, arch, sampling,
                                                                       how, kv_quant):
    model, payload = tiny_model_dirs[arch], body(sampling)
    reference, flushed, log = interrupt(model, tmp_path, payload, how, "--kv-quant", kv_quant)
    assert flushed["durable"] and flushed["checkpoints"]["requests"] == 1, flushed
    if how == "term":  # the shutdown's own flush reports the request's checkpoint (taken at the cancel)
        assert shutdown_checkpoints(log) == 1, log[-2000:]
    with serve(model, tmp_path, "--kv-quant", kv_quant) as server:
        resumed = complete(server.url, payload)
        flush(server.url)
        stats = httpx.get(server.url + "/stats").json()["checkpoints"]
        metrics = httpx.get(server.url + "/metrics").text
    assert resumed["choices"][0]["text"] == reference
    restored = resumed["usage"]["completion_tokens_details"]["checkpoint_tokens"]
    assert INTERRUPT_AT - INTERVAL <= restored < MAX_TOKENS
    assert resumed["usage"]["completion_tokens"] == MAX_TOKENS
    assert stats["restored"] == 1 and stats["restored_tokens"] == restored
    assert stats["files"] == 0 and stats["deleted"] == 1  # completion removed it
    assert "mlxq:checkpoints_restored_total 1.0" in metrics
    assert counter(metrics, "checkpoints_restored_tokens_total") == restored
    assert counter(metrics, "checkpoints_written_total") == stats["written"] >= 1  # the resumed run's links
    assert counter(metrics, "checkpoints_written_bytes_total") == stats["written_bytes"] > 0


def test_a_changed_sampling_field_never_resumes_another_checkpoint(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    interrupt(model, tmp_path, body(SEEDED, 600), "kill", reference=False)
    changed = [body({**SEEDED, "seed": 8}, 600), body({**SEEDED, "top_p": 0.9}, 600), body(SEEDED, 599),
               {**body(SEEDED, 600), "stop": ["zzz"]}, body(GREEDY, 600)]
    with serve(model, tmp_path) as server:
        for payload in changed:  # a restore would replay hundreds of tokens into the first chunks
            assert stream_until(server.url, payload, 1, leave=True).wait(120)
        stats = httpx.get(server.url + "/stats").json()["checkpoints"]
    assert stats["restored"] == 0
    rows = json.loads(cli("cache", "ls", str(tmp_path), "--json").stdout)
    checkpoints = [r for r in rows if r["kind"] == "checkpoint"]  # the left ones may have published too
    assert max(r["checkpoint"]["emitted_tokens"] for r in checkpoints) >= INTERRUPT_AT - INTERVAL
    assert all(r["durable"] for r in checkpoints)
    requests = len({r["checkpoint"]["key"] for r in checkpoints})  # one line each, its links counted
    assert f"generation checkpoints: {requests} requests, {len(checkpoints)} files" in cli(
        "cache", "ls", str(tmp_path)).stdout
    assert cli("cache", "verify", str(tmp_path)).exit_code == 0
    pruned = cli("cache", "prune", str(tmp_path), "--checkpoints")
    assert pruned.stdout.count("removed") == len(checkpoints) and not list(tmp_path.rglob("checkpoints/*"))
    assert [r for r in json.loads(cli("cache", "ls", str(tmp_path), "--json").stdout) if r["kind"] == "node"]


def test_cancelled_keeps_completed_drops_and_logprobs_are_never_checkpointed(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    with serve(model, tmp_path) as server:
        assert stream_until(server.url, body(GREEDY), 60, leave=True).wait(120)  # cancelled by the client
        time.sleep(0.5)
        assert flush(server.url)["checkpoints"]["requests"] == 1
        complete(server.url, {**body(GREEDY, 64), "logprobs": 1})
        complete(server.url, {**body(GREEDY, 64), "n": 2})
        assert flush(server.url)["checkpoints"]["requests"] == 1
        resumed = complete(server.url, body(GREEDY))
        assert resumed["usage"]["completion_tokens_details"]["checkpoint_tokens"] >= 48
        flushed = flush(server.url)
    assert flushed["checkpoints"]["files"] == 0
    assert not list(tmp_path.rglob("checkpoints/*.mlxkv"))


@pytest.mark.slow  # kills a server during writes, again and again: about 30 s on two cores
def test_kill_during_checkpoint_writes_never_restores_wrong_output(tiny_model_dirs, tmp_path):
    """Checkpoints every 4 tokens are being written all the time: kill -9 at two points, never a flush."""
    model, payload = tiny_model_dirs["gemma3_text"], body(SEEDED, 160)
    reference, restored = None, 0
    for tokens in (9, 61, None):
        with serve(model, tmp_path, "--checkpoint-interval", "4") as server:
            assert not list(tmp_path.rglob("*.tmp"))  # a cut write is reaped at start-up
            text = complete(server.url, payload)["choices"][0]["text"]
            assert text == (reference or text)
            reference = text
            restored += httpx.get(server.url + "/stats").json()["checkpoints"]["restored"]
            if tokens is not None:
                assert stream_until(server.url, payload, tokens).wait(120)
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait(60)
    assert restored >= 1


@pytest.mark.parametrize("batch", ["1", pytest.param("4", marks=SLOW)])
def test_a_full_disk_drops_checkpoints_not_requests(tiny_model_dirs, tmp_path, batch):
    """Files over 64 KiB fail as on a full disk (RLIMIT_FSIZE: EFBIG; Python ignores SIGXFSZ): in the serial
    lane and in the batch (alone in it: the serial text)."""
    model, payload = tiny_model_dirs["llama"], body(GREEDY, 120)
    with serve(model, tmp_path / "off", "--checkpoint-interval", "0") as server:
        reference = complete(server.url, payload)["choices"][0]["text"]
    with serve(model, tmp_path / "full", "--batch", batch, limit_file_bytes=64 * 1024) as server:
        assert complete(server.url, payload)["choices"][0]["text"] == reference
        flushed = httpx.post(server.url + "/admin/cache/flush", timeout=60).json()
        stats = httpx.get(server.url + "/stats").json()
        metrics = httpx.get(server.url + "/metrics").text
    lane = "serial" if batch == "1" else "continuous"
    assert stats["engine"]["lanes"][lane] == 1 and stats["engine"]["requests_failed"] == 0, stats["engine"]
    assert stats["checkpoints"]["dropped"] >= 1 and stats["checkpoints"]["written"] == 0
    assert flushed["durable"] is False and flushed["checkpoints"]["dropped"] >= 1
    assert counter(metrics, "checkpoints_dropped_total") == stats["checkpoints"]["dropped"]
    assert counter(metrics, "checkpoints_written_total") == 0


def counter(metrics: str, name: str) -> float:
    """A metric's value in /metrics' text (``mlxq:NAME value``)."""
    values = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(f"mlxq:{name} ")]
    assert len(values) == 1, name
    return values[0]


@pytest.mark.parametrize("arch, sampling", [("llama", GREEDY), pytest.param("gemma3_text", SEEDED, marks=SLOW),
                                            pytest.param("qwen3_next", SEEDED, marks=SLOW)])
def test_rows_of_a_batch_publish_and_a_restored_row_joins_a_batch(tiny_model_dirs, tmp_path, arch, sampling):
    """A batch of 4 with other rows joining and leaving, killed mid-generation; the restart resumes the row
    next to other rows and returns the text of the request run alone."""
    model, payload = tiny_model_dirs[arch], body(sampling)
    others = [{"prompt": f"Tell me about the number {n}.", "max_tokens": 40 + 60 * n, "ignore_eos": True,
               "temperature": 0} for n in range(1, 4)]
    with serve(model, tmp_path, "--batch", "4") as server:
        reference = complete(server.url, payload)["choices"][0]["text"]  # alone in the batch: the serial text
        for other in others[:2]:
            stream_until(server.url, other, 1)
        reached = stream_until(server.url, payload, INTERRUPT_AT)
        stream_until(server.url, others[2], 1)  # joins while the others run
        assert reached.wait(120)
        assert flush(server.url)["checkpoints"]["requests"] >= 1
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(60)
    with serve(model, tmp_path, "--batch", "4") as server:
        alongside = [stream_until(server.url, other, 10**6) for other in others[:2]]
        resumed = complete(server.url, payload)
        assert all(done.wait(120) for done in alongside)
        lanes = httpx.get(server.url + "/stats").json()["engine"]["lanes"]
    assert resumed["choices"][0]["text"] == reference
    assert resumed["usage"]["completion_tokens_details"]["checkpoint_tokens"] >= INTERRUPT_AT - INTERVAL
    assert lanes["continuous"] == 3 and resumed["usage"]["completion_tokens"] == MAX_TOKENS
