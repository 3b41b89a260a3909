"""A request that stops without finishing (the client leaves, SIGTERM) publishes its last checkpoint.

The checkpoint covers every token the row generated: those handed out, the one the engine had drawn when
it saw the cancel (not handed out), and the pending one drawn after it; so the same request afterwards
replays all of them (``checkpoint_tokens`` = handed out + 2) and recomputes nothing.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.server.test_checkpoints import GREEDY, INTERVAL, SEEDED, body, cli, complete, flush, serve, stream_until

CANCEL_AT = 45  # chunks the client reads before it leaves: not a multiple of the interval
assert CANCEL_AT % INTERVAL


def engine_stats(url: str) -> dict:
    return httpx.get(url + "/stats").json()["engine"]


def after_cancel(url: str, cancelled: int) -> dict:
    """The engine's stats once it has dropped the ``cancelled``-th cancelled request."""
    deadline = time.monotonic() + 60
    while (stats := engine_stats(url))["requests_cancelled"] < cancelled:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def resumed_text(url: str, payload: dict) -> tuple[str, int]:
    reply = complete(url, payload)
    return reply["choices"][0]["text"], reply["usage"]["completion_tokens_details"]["checkpoint_tokens"]


@pytest.mark.parametrize("batch", ["1", pytest.param("4", marks=pytest.mark.slow)])
def test_a_request_the_client_left_resumes_from_its_last_token(tiny_model_dirs, tmp_path, batch):
    """Greedy and seeded, serial lane (--batch 1) and batch lane: the re-sent request replays every token
    the left one generated, not the last interval's, and returns the uninterrupted text."""
    with serve(tiny_model_dirs["llama"], tmp_path, "--batch", batch) as server:
        for n, sampling in enumerate((GREEDY, SEEDED), start=1):
            payload = body(sampling, 400)
            reference = complete(server.url, payload)["choices"][0]["text"]  # completion removes its checkpoint
            before = engine_stats(server.url)
            assert stream_until(server.url, payload, CANCEL_AT, leave=True).wait(120)
            handed_out = after_cancel(server.url, n)["generated_tokens"] - before["generated_tokens"]
            assert handed_out >= CANCEL_AT
            text, restored = resumed_text(server.url, payload)
            assert text == reference
            assert restored == handed_out + 2, (restored, handed_out)
        assert flush(server.url)["checkpoints"]["files"] == 0  # completion removed them (behind their writes)
        stats = httpx.get(server.url + "/stats").json()
    lanes = stats["engine"]["lanes"]
    assert lanes["serial" if batch == "1" else "continuous"] == 6, lanes
    assert stats["checkpoints"]["restored"] == 2


@pytest.mark.parametrize("batch, sampling", [("1", GREEDY), pytest.param("4", SEEDED, marks=pytest.mark.slow)])  # ~13 s
def test_sigterm_publishes_a_running_request_last_checkpoint(tiny_model_dirs, tmp_path, batch, sampling):
    """An interval longer than the generation: only the checkpoint at SIGTERM can exist, and the SIGTERM
    flush makes it durable (no flush asked for)."""
    model, payload = tiny_model_dirs["llama"], body(sampling, 800)
    with serve(model, tmp_path, "--batch", batch, "--checkpoint-interval", "10000",
               "--shutdown-timeout", "0.2") as server:
        reference = complete(server.url, payload)["choices"][0]["text"]
        assert stream_until(server.url, payload, CANCEL_AT).wait(120)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    rows = [r for r in json.loads(cli("cache", "ls", str(tmp_path), "--json").stdout) if r["kind"] == "checkpoint"]
    assert len(rows) == 1 and rows[0]["durable"], rows
    emitted = rows[0]["checkpoint"]["emitted_tokens"]
    assert CANCEL_AT <= emitted < 800
    with serve(model, tmp_path, "--batch", batch) as server:
        text, restored = resumed_text(server.url, payload)
    assert text == reference and restored == emitted + 1
