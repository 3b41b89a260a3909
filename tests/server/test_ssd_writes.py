"""The SSD tier writes each state once: repeats add no files, the n choices of one prompt add only their tails."""

from __future__ import annotations

import httpx

from mlxq.golden.cases import LONG
from mlxq.store.mlxkv import read_header
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
    new = [read_header(p) for p in _files(tmp_path) if p not in on_disk]
    # The first choice's file is split when the second arrives (its head, the prompt, becomes a file; the
    # rest is rewritten): one write more than the files it leaves. The prompt is on disk once.
    assert stats["writes"] == written + len(new) + 1 and len(new) == 5
    prompt_tokens = r["usage"]["prompt_tokens"]
    assert sorted(len(h.tokens) for h in new)[-1] >= prompt_tokens - 1
    assert all(len(h.tokens) <= 8 for h in sorted(new, key=lambda h: len(h.tokens))[:-1])
