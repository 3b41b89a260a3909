"""The SSD tier writes each state once: repeats and the n choices of one prompt add no files."""

from __future__ import annotations

import httpx

from mlxq.golden.cases import LONG
from tests.conftest import ServerProcess


def _flush_and_stats(url: str) -> dict:
    assert httpx.post(url + "/admin/cache/flush", timeout=60).json()["durable"]
    return httpx.get(url + "/stats").json()["ssd_cache"]


def _files(root) -> dict:
    return {p: p.stat().st_ino for p in root.rglob("*.mlxkv")}


def test_repeats_and_n_choices_write_once(tiny_model_dirs, tmp_path):
    first = {"prompt": " ".join([LONG] * 3), "max_tokens": 8, "temperature": 0}
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(tmp_path)) as server:
        assert httpx.post(server.url + "/v1/completions", json=first, timeout=120).status_code == 200
        written = _flush_and_stats(server.url)["writes"]
        on_disk = _files(tmp_path)
        for _ in range(3):
            r = httpx.post(server.url + "/v1/completions", json=first, timeout=120).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        stats = _flush_and_stats(server.url)
        assert stats["writes"] == written and _files(tmp_path) == on_disk  # the same file, never rewritten
        chosen = {"prompt": "Once more: " + " ".join([LONG] * 2), "max_tokens": 8, "temperature": 1.0, "seed": 3,
                  "n": 4}
        r = httpx.post(server.url + "/v1/completions", json=chosen, timeout=120).json()
        assert len({c["text"] for c in r["choices"]}) > 1  # the choices differ (their tails diverge)
        stats = _flush_and_stats(server.url)
    assert stats["writes"] == written + 1 and stats["siblings_skipped"] == 3
    assert len(_files(tmp_path)) == len(on_disk) + 1
