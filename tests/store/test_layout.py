"""Files with valid checksums but another model's shape are refused and removed, never restored."""

from __future__ import annotations

import signal

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq.golden.cases import LONG
from mlxq.kv.scheme import probe_caches
from mlxq.store.layout import check_layout, layout_of
from mlxq.store.mlxkv import Identity, MlxkvError, read_header, run_steps
from mlxq.store.ssd_store import SsdStore
from tests.conftest import ServerProcess
from tests.store.test_cold_tier import whole

IDENTITY = Identity("b" * 16, "native", "")


def _prefilled(model, tokens: list[int]) -> list:
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _narrower(cache: KVCache) -> KVCache:
    out = KVCache()
    out.state = (cache.keys[..., :32], cache.values[..., :32], cache.offset)
    return out


def _as_float16(cache: KVCache) -> KVCache:
    out = KVCache()
    out.state = (cache.keys.astype(mx.float16), cache.values.astype(mx.float16), cache.offset)
    return out


CRAFTED = {
    "a layer dropped": lambda caches: caches[:-1],
    "a layer added": lambda caches: caches + caches[:1],
    "a narrower head": lambda caches: [_narrower(caches[0]), *caches[1:]],
    "another dtype": lambda caches: [*caches[:-1], _as_float16(caches[-1])],
}


@pytest.mark.parametrize("craft", list(CRAFTED), ids=list(CRAFTED))
def test_crafted_files_are_removed_at_scan(load_tiny, tmp_path, craft):
    model, _ = load_tiny("llama")
    tokens = list(range(1, 40))
    writer = SsdStore(tmp_path, IDENTITY)  # no layout: writes whatever it is given, checksummed
    run_steps(writer.write_steps("", tuple(tokens), whole(CRAFTED[craft](_prefilled(model, tokens))), True))
    good = SsdStore(tmp_path, IDENTITY)
    run_steps(good.write_steps("", tuple(tokens[:20]), whole(_prefilled(model, tokens[:20])), True))
    store = SsdStore(tmp_path, IDENTITY, layout=layout_of(probe_caches(model)))
    store.scan()
    assert store.stats.corrupt_removed == 1 and [len(e.tokens) for e in store.files.values()] == [20]
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 1


def test_the_layout_check_reads_headers_only(load_tiny, tmp_path):
    model, _ = load_tiny("llama")
    layout = layout_of(probe_caches(model))
    store = SsdStore(tmp_path, IDENTITY)
    tokens = tuple(range(1, 30))
    run_steps(store.write_steps("", tokens, whole(_prefilled(model, list(tokens))), True))
    (path,) = tmp_path.rglob("*.mlxkv")
    header = read_header(path)
    check_layout(layout, header.layers, len(tokens), len(tokens))
    with pytest.raises(MlxkvError, match="offset"):
        check_layout(layout, header.layers, len(tokens) + 1, len(tokens) + 1)
    header.layers[0]["tensors"][0]["nbytes"] += 4
    with pytest.raises(MlxkvError, match="bytes for shape"):
        check_layout(layout, header.layers, len(tokens), len(tokens))


def test_a_file_swapped_after_the_scan_is_removed_at_restore_and_the_request_prefills(tiny_model_dirs, tmp_path,
                                                                                    load_tiny):
    """The crafted file passes every checksum; the server removes it and answers as if it had no cache."""
    model, tokenizer = load_tiny("llama")
    body = {"prompt": " ".join([LONG] * 3), "max_tokens": 8, "temperature": 0}
    args = ("--model", str(tiny_model_dirs["llama"]), "--batch", "1", "--ssd-cache", str(tmp_path))
    with ServerProcess(*args) as server:
        expected = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert httpx.post(server.url + "/admin/cache/flush", timeout=60).json()["durable"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    with ServerProcess(*args) as server:  # scanned: the good file is indexed
        (path,) = tmp_path.rglob("*.mlxkv")
        header = read_header(path)
        crafted = SsdStore(tmp_path / "crafted", header.identity)
        caches = _prefilled(model, list(header.tokens))[:-1]  # a layer dropped, checksums all valid
        run_steps(crafted.write_steps(header.identity.namespace, header.tokens, whole(caches), header.trimmable))
        (bad,) = (tmp_path / "crafted").rglob("*.mlxkv")
        bad.replace(path)
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        stats = httpx.get(server.url + "/stats").json()["ssd_cache"]
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stats["corrupt_removed"] == 1 and stats["restores"] == 0
    # The same span's name is its digest: what the server wrote again in its place is the good file.
    assert not path.exists() or len(read_header(path).layers) == len(header.layers)
