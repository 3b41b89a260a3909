"""A checkpoint is a chain of links, each holding only the span since the one before: through real servers,
kill -9, real files and the `mlxq cache` commands."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import pytest

from tests.server.test_checkpoints import (
    GREEDY,
    INTERRUPT_AT,
    INTERVAL,
    body,
    cli,
    complete,
    flush,
    serve,
    stream_until,
)


def kv_bytes_per_token(model) -> int:
    """Full-attention KV per token of a model directory, from its config alone (float32 tiny models)."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert config["torch_dtype"] == "float32"
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4


def corrupt_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a tensor's last byte: the header is fine, the checksum is not
    path.write_bytes(bytes(data))


@pytest.mark.slow  # a long generation restored three times: about 20 s on two cores
def test_a_chain_of_links_restores_exactly_and_a_corrupt_middle_link_is_a_miss(tiny_model_dirs, tmp_path):
    model, payload = tiny_model_dirs["llama"], body(GREEDY)
    cache, corrupted = tmp_path / "cache", tmp_path / "corrupted"
    with serve(model, cache, "--shutdown-timeout", "0.2") as server:
        reference = complete(server.url, payload)["choices"][0]["text"]  # completion removes its chain
        flush(server.url)
        before = httpx.get(server.url + "/stats").json()["checkpoints"]["written_bytes"]
        assert stream_until(server.url, payload, INTERRUPT_AT).wait(120)
        flushed = flush(server.url)
        stats = httpx.get(server.url + "/stats").json()["checkpoints"]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(60)
    assert flushed["durable"] and flushed["checkpoints"]["requests"] == 1, flushed

    # A link may be cut mid-write by the kill (a .tmp, listed as not durable): the chain is the durable ones.
    rows = [r for r in json.loads(cli("cache", "ls", str(cache), "--json").stdout)
            if r["kind"] == "checkpoint" and r["durable"]]
    chain = sorted(rows, key=lambda r: r["end"])
    assert len(chain) >= 3 and chain[0]["start"] == 0
    assert all(after["start"] == before["end"] for before, after in zip(chain, chain[1:], strict=False))
    assert "1 requests" in cli("cache", "ls", str(cache)).stdout
    # Every durable file checks out; a link the kill cut mid-write is named as an unfinished write.
    verified = cli("cache", "verify", str(cache))
    bad = [line for line in verified.stdout.splitlines() if line.startswith("BAD ")]
    assert all(line.endswith("unfinished write (.tmp)") for line in bad), verified.stdout
    assert verified.exit_code == (1 if bad else 0), verified.stdout
    # Each token's KV is copied once: the interrupted generation's links hold about one full checkpoint's
    # bytes at its end (a link may land between the stats and the kill), not the sum of every prefix.
    full = kv_bytes_per_token(model) * chain[-1]["end"]
    assert 0.5 * full <= stats["written_bytes"] - before <= 1.5 * full

    shutil.copytree(cache, corrupted)
    middle = next(corrupted.rglob(chain[len(chain) // 2]["file"].split("/")[-1]))
    corrupt_last_byte(middle)
    assert cli("cache", "verify", str(corrupted)).exit_code == 1  # the link and every link above it
    with serve(model, corrupted) as server:
        missed = complete(server.url, payload)
        missed_stats = httpx.get(server.url + "/stats").json()["checkpoints"]
    assert missed["choices"][0]["text"] == reference
    assert "completion_tokens_details" not in missed["usage"] and missed_stats["restored"] == 0
    assert missed_stats["corrupt_removed"] >= 1

    with serve(model, cache) as server:
        resumed = complete(server.url, payload)
    assert resumed["choices"][0]["text"] == reference
    assert resumed["usage"]["completion_tokens_details"]["checkpoint_tokens"] >= INTERRUPT_AT - INTERVAL
