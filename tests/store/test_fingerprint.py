"""A model's identity covers every weight byte, and costs one hash per shard, not one per start-up."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from mlxq.golden.cases import LONG
from mlxq.models.tiny import build_tiny_model
from mlxq.store.fingerprint import FINGERPRINT_MEMO, model_fingerprint
from tests.conftest import ServerProcess

SAMPLE = 1 << 20  # what the old identity read: 1 MiB at the start, the middle and the end of each shard


@pytest.fixture(scope="module")
def twin_models(tmp_path_factory) -> tuple[Path, Path]:
    """Two same-size models whose weights differ only between the old samples (far from the start)."""
    root = tmp_path_factory.mktemp("twins")
    a = build_tiny_model("llama", root / "a", preset="default")
    b = root / "b"
    shutil.copytree(a, b)
    shard = b / "model.safetensors"
    data = bytearray(shard.read_bytes())
    size = len(data)
    header_end = 8 + int.from_bytes(data[:8], "little")
    lo, hi = SAMPLE + 4096, size // 2 - SAMPLE // 2 - 4096
    assert hi - lo > 65536 and lo > header_end, "the shard must be big enough to hide an edit"
    start = lo + (header_end - lo) % 4  # float32-aligned within the data section
    for i in range(start + 3, start + 65536, 4):
        data[i] ^= 0x80  # flip the sign of 16k float32 weights
    shard.write_bytes(bytes(data))
    assert shard.stat().st_size == (a / "model.safetensors").stat().st_size
    return a, b


def test_twins_differing_outside_the_old_samples_get_different_identities(twin_models, tmp_path):
    a, b = twin_models
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a, tmp_path / FINGERPRINT_MEMO) == model_fingerprint(a)


def test_the_digest_is_memoized_by_stat_and_refreshed_on_edit(twin_models, tmp_path):
    a, _ = twin_models
    model = tmp_path / "m"
    shutil.copytree(a, model)
    memo_path = tmp_path / FINGERPRINT_MEMO
    first = model_fingerprint(model, memo_path)
    memo = json.loads(memo_path.read_text())
    (entry,) = memo.values()
    # The memo is what a second start-up reads: a doctored digest shows through, so the shard was not re-read.
    entry["xxh3_128"] = "0" * 32
    memo_path.write_text(json.dumps(memo))
    assert model_fingerprint(model, memo_path) != first
    # Any write to the shard changes its stat key, so the doctored digest is replaced by a real one.
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes())
    assert model_fingerprint(model, memo_path) == first
    # A damaged memo file costs a re-hash, nothing else.
    memo_path.write_text("{not json")
    assert model_fingerprint(model, memo_path) == first


def test_twin_models_never_share_kv_through_the_ssd_tier(twin_models, tmp_path):
    a, b = twin_models
    body = {"prompt": " ".join([LONG] * 3), "max_tokens": 8, "temperature": 0}
    with ServerProcess("--model", str(a), "--ssd-cache", str(tmp_path)) as server:
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        assert httpx.post(server.url + "/admin/cache/flush", timeout=60).json()["durable"]
        identity_a = httpx.get(server.url + "/stats").json()["ssd_cache"]["fingerprint"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 1
    with ServerProcess("--model", str(b)) as server:  # the oracle: b's own answer, no cache at all
        expected = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    with ServerProcess("--model", str(b), "--ssd-cache", str(tmp_path)) as server:
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        ssd = httpx.get(server.url + "/stats").json()["ssd_cache"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ssd["restores"] == 0 and ssd["fingerprint"] != identity_a
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]


def test_an_unwritable_memo_location_costs_only_the_memo(twin_models, tmp_path):
    a, _ = twin_models
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert model_fingerprint(a, blocker / "cache" / FINGERPRINT_MEMO) == model_fingerprint(a)
