"""The SSD tier through real servers: restarts, the flush barrier, corruption, failures, kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxq.golden.cases import LONG
from tests.conftest import ServerProcess

PROMPT = " ".join([LONG] * 4)  # a few hundred tokens: past gemma3_text's 16-token window


def complete(url: str, prompt: str = PROMPT) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxq.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def stop(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0


@pytest.mark.parametrize("arch, batch, kv_quant", [("llama", "8", "off"),
                                                   pytest.param("llama", "1", "off", marks=pytest.mark.slow),
                                                   pytest.param("gemma3_text", "8", "off", marks=pytest.mark.slow),
                                                   pytest.param("qwen3_next", "8", "off", marks=pytest.mark.slow),
                                                   ("gemma3_text", "8", "8")])
def test_a_flushed_prefix_survives_a_restart(tiny_model_dirs, tmp_path, arch, batch, kv_quant):
    args = ("--model", str(tiny_model_dirs[arch]), "--batch", batch, "--ssd-cache", str(tmp_path),
            "--kv-quant", kv_quant)
    with ServerProcess(*args) as server:
        first = complete(server.url)
        flushed = cli("cache", "flush", "--url", server.url)
        assert flushed.returncode == 0, flushed.stdout + flushed.stderr
        assert json.loads(flushed.stdout)["durable"] is True
        stop(server)
    with ServerProcess(*args) as server:
        ssd = httpx.get(server.url + "/stats").json()["ssd_cache"]
        assert ssd["entries"] >= 1 and ssd["restores"] == 0
        again = complete(server.url)
        ssd = httpx.get(server.url + "/stats").json()["ssd_cache"]
        metrics = httpx.get(server.url + "/metrics").text
    assert "mlxq:ssd_cache_restores_total 1.0" in metrics and "mlxq:ssd_cache_entries" in metrics
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert ssd["restores"] == 1 and ssd["restored_tokens"] >= prompt_tokens - 1


def test_sigterm_alone_makes_the_cache_durable(tiny_model_dirs, tmp_path):
    """With write-behind off nothing is written while serving: the graceful stop must flush."""
    args = ("--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(tmp_path))
    with ServerProcess(*args, env={"MLXQ_SSD_WRITE_BEHIND": "0"}) as server:
        first = complete(server.url)
        assert httpx.get(server.url + "/stats").json()["ssd_cache"]["pending"] == 1
        assert not list(tmp_path.rglob("*.mlxkv"))
        stop(server)
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 1
    with ServerProcess(*args) as server:
        again = complete(server.url)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_flipped_bytes_are_named_by_verify_and_never_served(tiny_model_dirs, tmp_path):
    args = ("--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(tmp_path))
    with ServerProcess(*args) as server:
        first = complete(server.url)
        assert httpx.post(server.url + "/admin/cache/flush").json()["durable"]
        stop(server)
    (path,) = tmp_path.rglob("*.mlxkv")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of the last layer's values
    path.write_bytes(bytes(data))
    verified = cli("cache", "verify", str(tmp_path))
    assert verified.returncode == 1 and str(path) in verified.stdout and "checksum" in verified.stdout
    with ServerProcess(*args) as server:
        again = complete(server.url)
        ssd = httpx.get(server.url + "/stats").json()["ssd_cache"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ssd["corrupt_removed"] == 1 and ssd["restores"] == 0
    # A span's name is its digest: the server wrote the good state again under the same name.
    assert cli("cache", "verify", str(tmp_path)).returncode == 0


def test_an_unwritable_cache_directory_never_stops_serving(tiny_model_dirs, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(blocker / "cache")) as server:
        first = complete(server.url)
        second = complete(server.url)  # still served, and from the RAM tier
        flush = httpx.post(server.url + "/admin/cache/flush")
        ssd = httpx.get(server.url + "/stats").json()["ssd_cache"]
        flushed = cli("cache", "flush", "--url", server.url)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert flush.status_code == 503
    body = flush.json()
    assert body["durable"] is False and body["failed"] >= 1 and body["pending"] >= 1
    assert ssd["failed"] >= 2 and ssd["entries"] == 0
    assert flushed.returncode == 1


def test_flush_without_an_ssd_tier_is_a_clear_error(llama_server):
    r = httpx.post(llama_server.url + "/admin/cache/flush")
    assert r.status_code == 409 and r.json()["error"]["code"] == "ssd_cache_off"
    assert "--ssd-cache" in r.json()["error"]["message"]
    bad = httpx.post(llama_server.url + "/admin/cache/flush", params={"timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
    assert cli("cache", "flush", "--url", llama_server.url).returncode == 2
    assert httpx.get(llama_server.url + "/stats").json()["ssd_cache"]["enabled"] is False


def test_ssd_flags_need_the_ram_tier(tiny_model_dirs, tmp_path):
    r = cli("serve", "--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(tmp_path), "--prompt-cache", "0")
    assert r.returncode == 2 and "--prompt-cache" in r.stderr


def test_the_ram_tier_never_holds_more_than_its_cap(tiny_model_dirs):
    cap = 3 * 10**6
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--prompt-cache", str(cap)) as server:
        seen = []
        for i in range(12):
            complete(server.url, f"request {i}: " + " ".join([LONG] * (1 + i % 3)))
            seen.append(httpx.get(server.url + "/stats").json()["prompt_cache"])
    assert all(s["bytes"] <= cap for s in seen)
    assert seen[-1]["evictions"] > 0 and seen[-1]["max_bytes"] == cap


_WRITER = """
import sys
from pathlib import Path
import mlxq, mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlxq.store.mlxkv import Identity
from mlxq.store.ssd_store import SsdStore

store = SsdStore(Path(sys.argv[1]), Identity("c" * 16, "native", ""))
for i in range(1000):
    caches = []
    for layer in range(4):
        c = KVCache()
        k = mx.random.normal((1, 8, 2048, 128))
        c.update_and_fetch(k, k)
        caches.append(c)
    for _ in store.write_steps("", tuple(range(i, i + 2048)), lambda start: caches, True):
        pass
    print("wrote", i, flush=True)
"""


def test_kill_9_during_writes_leaves_no_partial_entry(tmp_path):
    """A writer killed mid-file: a restarted store serves only whole entries; verify is clean."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().startswith("wrote 0")  # one whole entry on disk
        deadline = time.monotonic() + 60
        while not list(tmp_path.rglob("*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert list(tmp_path.rglob("*.tmp")), "the kill did not land during a write"
    from mlxq.store.mlxkv import Identity
    from mlxq.store.ssd_store import SsdStore

    store = SsdStore(tmp_path, Identity("c" * 16, "native", ""))
    store.scan()
    assert store.stats.reaped_tmp == 1 and store.stats.corrupt_removed == 0 and len(store.files) >= 1
    assert all(len(e.tokens) == 2048 for e in store.files.values())
    verified = cli("cache", "verify", str(tmp_path))
    assert verified.returncode == 0, verified.stdout
    assert not list(Path(tmp_path).rglob("*.tmp"))


def test_a_kv_scheme_change_never_restores_or_removes_the_other_schemes_files(tiny_model_dirs, tmp_path):
    native = ("--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(tmp_path))
    with ServerProcess(*native) as server:
        complete(server.url)
        assert httpx.post(server.url + "/admin/cache/flush").json()["durable"]
        stop(server)
    (native_file,) = tmp_path.rglob("*.mlxkv")
    with ServerProcess(*native, "--kv-quant", "8") as server:
        quantized = complete(server.url)
        stats = httpx.get(server.url + "/stats").json()
        assert httpx.post(server.url + "/admin/cache/flush").json()["durable"]
        stop(server)
    assert quantized["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not the native entry
    assert stats["kv"]["scheme"] == "kv8g64" and any(d.name.endswith("-kv8g64") for d in tmp_path.iterdir())
    assert native_file.exists() and len(list(tmp_path.rglob("*.mlxkv"))) == 2
    with ServerProcess(*native, "--kv-quant", "8") as server:  # and the quantized entry restores itself
        again = complete(server.url)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == quantized["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["text"] == quantized["choices"][0]["text"]
