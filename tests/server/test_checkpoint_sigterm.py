"""SIGTERM in a batch of 4 with rows joining and leaving: the shutdown's flush reports the checkpoints it made
durable, and the interrupted row resumes beside other rows to the text of the request run alone."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.server.test_checkpoints import (
    GREEDY,
    INTERRUPT_AT,
    body,
    cli,
    complete,
    serve,
    shutdown_checkpoints,
    stream_until,
)

MAX_TOKENS = 400  # past INTERRUPT_AT: the SIGTERM lands mid-generation (else the attempt is run again)


def others() -> list[dict]:
    return [{"prompt": f"Tell me about the number {n}.", "max_tokens": 40 + 60 * n, "ignore_eos": True,
             "temperature": 0} for n in range(1, 4)]


def checkpoint_rows(cache) -> list[dict]:
    return [r for r in json.loads(cli("cache", "ls", str(cache), "--json").stdout) if r["kind"] == "checkpoint"]


@pytest.mark.parametrize("arch", [pytest.param("gemma3_text", marks=pytest.mark.slow), "qwen3_next"])  # ~15 s each
def test_sigterm_in_a_batch_reports_its_checkpoints_and_the_row_resumes(tiny_model_dirs, tmp_path, arch):
    """Greedy, no flush asked for: the request running at SIGTERM is cancelled, publishes its last
    checkpoint, and the shutdown's flush makes it durable and says so (its log line counts every request
    with a checkpoint on disk, the other rows still running at the signal included)."""
    model, payload = tiny_model_dirs[arch], body(GREEDY, MAX_TOKENS)
    reference = None
    for _ in range(3):  # on a loaded host the generation may end before the signal: nothing to resume then
        with serve(model, tmp_path, "--batch", "4", "--shutdown-timeout", "0.2", "--log-level", "info") as server:
            if reference is None:
                reference = complete(server.url, payload)["choices"][0]["text"]  # completion removes its checkpoint
            for other in others()[:2]:
                stream_until(server.url, other, 1)
            reached = stream_until(server.url, payload, INTERRUPT_AT)
            stream_until(server.url, others()[2], 1)  # joins while the others run
            assert reached.wait(120)
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(60) == 0
            log = server.proc.stdout.read()
        rows = [r for r in checkpoint_rows(tmp_path) if r["durable"]]
        if any(r["checkpoint"]["emitted_tokens"] >= INTERRUPT_AT for r in rows):
            break
    assert shutdown_checkpoints(log) == len({r["checkpoint"]["key"] for r in rows}) >= 1, log[-2000:]
    emitted = max(r["checkpoint"]["emitted_tokens"] for r in rows)
    assert INTERRUPT_AT <= emitted < MAX_TOKENS

    with serve(model, tmp_path, "--batch", "4") as server:
        alongside = [stream_until(server.url, other, 10**6) for other in others()[:2]]
        resumed = complete(server.url, payload)
        assert all(done.wait(120) for done in alongside)
        lanes = httpx.get(server.url + "/stats").json()["engine"]["lanes"]
    assert resumed["choices"][0]["text"] == reference
    assert resumed["usage"]["completion_tokens_details"]["checkpoint_tokens"] == emitted + 1  # and the pending one
    assert lanes["continuous"] == 3 and resumed["usage"]["completion_tokens"] == MAX_TOKENS
