"""The SSD tier under `--tensor-parallel 2` and `--pipeline-parallel 2` (CPU, ring over loopback): each rank
writes its part of every entry in its own folder, a restart restores a prefix on both ranks, and an entry
missing or corrupt on one rank is a clean miss everywhere; `mlxq cache` reports an entry missing a rank's
file broken and prunes it; a flush is durable only once every rank's part is."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxq.golden.cases import LONG
from mlxq.models.tiny import build_tiny_model
from tests.conftest import ServerProcess

PROMPT = " ".join([LONG] * 2)
SERVE = ("--log-level", "warning", "--warmup", "off")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """The "default" size: 2 KV heads, one per rank."""
    return str(build_tiny_model("llama", tmp_path_factory.mktemp("tp-ssd") / "llama", preset="default"))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    """No shard() in mlx-lm, only pipeline(): 4 layers, 2 per rank, each rank a linear-attention layer
    (recurrent state) and a full-attention layer (KV)."""
    return str(build_tiny_model("qwen3_next", tmp_path_factory.mktemp("pp-ssd") / "qwen3_next", preset="default"))


def _complete(url: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxq.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def _flush_and_stop(server: ServerProcess) -> None:
    flushed = _cli("cache", "flush", "--url", server.url)
    assert flushed.returncode == 0 and json.loads(flushed.stdout)["durable"] is True, flushed.stdout
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0


def _rank_files(directory: Path) -> dict[str, list[str]]:
    """Each rank folder's .mlxkv files, by their path below the folder."""
    out: dict[str, list[str]] = {}
    for path in sorted(directory.rglob("*.mlxkv")):
        out.setdefault(path.parents[1].name, []).append(f"{path.parent.name}/{path.name}")
    return out


def _cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow  # two ranks started three times: about 55 s on two cores
def test_a_restart_restores_on_both_ranks_or_on_neither(llama, tmp_path):
    with ServerProcess("--model", llama, *SERVE) as one:
        alone = _complete(one.url)
    directory = tmp_path / "two"
    args = ("--model", llama, "--tensor-parallel", "2", "--ssd-cache", str(directory), *SERVE)
    with ServerProcess(*args) as two:
        first = _complete(two.url)
        _flush_and_stop(two)
    files = _rank_files(directory)
    assert sorted(files) == ["tp2-rank0", "tp2-rank1"] and files["tp2-rank0"] == files["tp2-rank1"]
    with ServerProcess(*args) as two:
        again = _complete(two.url)
        ssd = httpx.get(f"{two.url}/stats", timeout=10).json()["ssd_cache"]
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == alone["choices"][0]["text"]
    assert _cached(again) == alone["usage"]["prompt_tokens"] - 1  # what one process restores (test_ssd_cache.py)
    assert ssd["restores"] == 1 and ssd["restores_ranks_apart"] == 0

    # One rank's file gone: the entry is a miss on both ranks, the prompt is prefilled, the answer the same.
    victim = next(directory.rglob("tp2-rank1/*/*.mlxkv"))
    victim.unlink()
    listed = json.loads(_cli("cache", "ls", str(directory), "--json").stdout)
    broken = [row for row in listed if row["problem"]]
    assert [row["rank"] for row in broken] == [0] and "rank 1's file is missing" in broken[0]["problem"]
    with ServerProcess(*args) as two:
        missed = _complete(two.url)
        ssd = httpx.get(f"{two.url}/stats", timeout=10).json()["ssd_cache"]
        stats = httpx.get(f"{two.url}/stats", timeout=10).json()["distributed"]
    assert _cached(missed) == 0 and missed["choices"][0]["text"] == alone["choices"][0]["text"]
    assert ssd["restores"] == 0 and ssd["restores_ranks_apart"] == 1
    assert stats["failure"] is None

    assert _rank_files(directory)["tp2-rank1"] == files["tp2-rank1"]  # rank 1 wrote its part again

    # Both files present, rank 1's with flipped bytes: found on both ranks, read whole on rank 0 only, so
    # dropped on both (rank 1 removes its bad file and writes it again).
    flipped = next(directory.rglob("tp2-rank1/*/*.mlxkv"))
    data = bytearray(flipped.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
    flipped.write_bytes(bytes(data))
    with ServerProcess(*args) as two:
        unread = _complete(two.url)
        ssd = httpx.get(f"{two.url}/stats", timeout=10).json()["ssd_cache"]
    assert _cached(unread) == 0 and unread["choices"][0]["text"] == alone["choices"][0]["text"]
    assert ssd["restores_ranks_apart"] == 1
    assert _rank_files(directory)["tp2-rank1"] == files["tp2-rank1"]

    next(directory.rglob("tp2-rank1/*/*.mlxkv")).unlink()
    pruned = _cli("cache", "prune", str(directory), "--older-than", "7d")
    assert pruned.returncode == 0 and "1 files" in pruned.stdout, pruned.stdout
    assert _rank_files(directory) == {}

    # Rank 1 cannot write (its namespace folder is a file now): the flush waits for it and is not durable.
    folder = next(p for p in directory.glob("*/tp2-rank1/*") if p.is_dir())
    folder.rmdir()
    folder.write_text("not a folder")
    with ServerProcess(*args) as two:
        _complete(two.url)
        flushed = _cli("cache", "flush", "--url", two.url)
    assert flushed.returncode == 1 and json.loads(flushed.stdout)["durable"] is False, flushed.stdout
    assert sorted(_rank_files(directory)) == ["tp2-rank0"]


@pytest.mark.slow  # pipeline ranks started twice: about 35 s
def test_pipeline_ranks_restore_their_own_layers_together_or_not_at_all(qwen3_next, tmp_path):
    with ServerProcess("--model", qwen3_next, *SERVE) as one:
        alone = _complete(one.url)
    directory = tmp_path / "pp"
    args = ("--model", qwen3_next, "--pipeline-parallel", "2", "--ssd-cache", str(directory), *SERVE)
    with ServerProcess(*args) as two:
        first = _complete(two.url)
        _flush_and_stop(two)
    files = _rank_files(directory)
    assert sorted(files) == ["pp2-rank0", "pp2-rank1"] and files["pp2-rank0"] == files["pp2-rank1"]
    with ServerProcess(*args) as two:
        again = _complete(two.url)
        ssd = httpx.get(f"{two.url}/stats", timeout=10).json()["ssd_cache"]
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == alone["choices"][0]["text"]
    assert _cached(again) >= alone["usage"]["prompt_tokens"] - 1  # as one process (test_ssd_cache.py)
    assert ssd["restores"] == 1 and ssd["restores_ranks_apart"] == 0

    next(directory.rglob("pp2-rank1/*/*.mlxkv")).unlink()  # rank 1's layers gone: a miss on both ranks
    listed = json.loads(_cli("cache", "ls", str(directory), "--json").stdout)
    assert [row["rank"] for row in listed if row["problem"]] == [0]
    with ServerProcess(*args) as two:
        missed = _complete(two.url)
        ssd = httpx.get(f"{two.url}/stats", timeout=10).json()["ssd_cache"]
    assert _cached(missed) == 0 and missed["choices"][0]["text"] == alone["choices"][0]["text"]
    assert ssd["restores"] == 0 and ssd["restores_ranks_apart"] == 1
