"""LoRA / DoRA adapters served per request: mixed batches against mlx-lm's own adapter loading, routing, namespaces."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm import stream_generate

from mlxq.golden.cases import LONG
from mlxq.models.adapters import AdapterError, AdapterSpec, adapter_identity, check_adapter_dir
from mlxq.models.default import ensure_default_model
from mlxq.models.tiny_adapter import make_tiny_adapter
from tests.conftest import ServerProcess
from tests.server.test_batching import StatsWatcher, stream_completion, wait_drained

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dirs, tmp_path_factory):
    """arch -> (LoRA adapter on every linear layer, DoRA adapter on three projections)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for arch in ("llama", "qwen3", "gemma3_text"):
        lora = make_tiny_adapter(tiny_model_dirs[arch], root / arch / "lora", seed=11, rank=4)
        dora = make_tiny_adapter(tiny_model_dirs[arch], root / arch / "dora", seed=12, rank=8, kind="dora",
                                 keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"], num_layers=1)
        made[arch] = (lora, dora)
    return made


def oracle_text(model_dir, adapter_dir, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    """Greedy text of mlx-lm itself with ``load(model, adapter_path=...)`` (EOS excluded)."""
    model, tokenizer = mlx_lm.load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)
    return "".join(r.text for r in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens))


def _prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(LONG)
    return [ids[: 18 + 9 * i] for i in range(6)]  # past gemma3's 16-token window, each its own length


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("gemma3_text", marks=pytest.mark.slow)])  # ~12-20 s each
def test_mixed_adapter_batch_equals_each_adapters_oracle(arch, tiny_model_dirs, adapter_dirs, load_tiny):
    lora, dora = adapter_dirs[arch]
    model_dir = tiny_model_dirs[arch]
    prompts = _prompts(load_tiny(arch)[1])
    plan = [(name, prompts[i]) for i, name in enumerate(["base", "lora", "dora"] * 2)]  # interleaved, c=6
    paths = {"base": None, "lora": lora, "dora": dora}
    # Rows leave the batch one by one; long enough that the first is still decoding when the last
    # joins, however slowly the host admits requests (a /stats poll must see them together).
    lengths = [48 + 8 * i for i in range(len(plan))]
    expected = [oracle_text(model_dir, paths[name], prompt, n) for (name, prompt), n in zip(plan, lengths, strict=True)]
    on_first = {oracle_text(model_dir, path, plan[0][1]) for path in paths.values()}
    assert len(on_first) == 3, "each adapter must change what the model says"
    with ServerProcess("--model", str(model_dir), "--batch", "8", "--adapter", f"lora={lora}",
                       "--adapter", f"dora={dora}", "--prompt-cache", "0", "--log-level", "warning") as server:
        bodies = [{"model": name if name != "base" else "default_model", "prompt": prompt,
                   "max_tokens": n} for (name, prompt), n in zip(plan, lengths, strict=True)]

        async def run_all():
            # Staggered: later rows join a running batch (extend) while earlier ones leave (filter).
            return await asyncio.gather(*(stream_completion(server.url, body, delay=0.02 * i)
                                          for i, body in enumerate(bodies)))

        with StatsWatcher(server.url) as watcher:
            results = asyncio.run(run_all())
        assert watcher.max_rows >= 3, "rows of different adapters must have decoded together"
        assert [r["text"] for r in results] == expected


@pytest.fixture(scope="module")
def adapter_server(tiny_model_dirs, adapter_dirs, tmp_path_factory):
    lora, dora = adapter_dirs["llama"]
    ssd = tmp_path_factory.mktemp("ssd")
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--served-model-name", "base",
                       "--adapter", f"A={lora}", "--adapter", f"B={dora}", "--ssd-cache", str(ssd),
                       "--warmup", "on", "--log-level", "warning") as server:
        server.ssd = ssd
        yield server


def _complete(url: str, model: str, prompt: list[int], **fields) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                  **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_prompt_under_another_adapter_is_never_a_cache_hit(adapter_server, tiny_model_dirs, adapter_dirs,
                                                                 load_tiny):
    lora, dora = adapter_dirs["llama"]
    prompt = load_tiny("llama")[1].encode(LONG)[:60]
    first_a = _complete(adapter_server.url, "A", prompt)
    first_b = _complete(adapter_server.url, "B", prompt)
    again_b = _complete(adapter_server.url, "B", prompt)
    base = _complete(adapter_server.url, "base", prompt)
    assert first_a["choices"][0]["text"] == oracle_text(tiny_model_dirs["llama"], lora, prompt)
    assert first_b["choices"][0]["text"] == oracle_text(tiny_model_dirs["llama"], dora, prompt)
    assert again_b["choices"][0]["text"] == first_b["choices"][0]["text"]
    assert base["choices"][0]["text"] == oracle_text(tiny_model_dirs["llama"], None, prompt)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first_a, first_b, again_b, base)]
    assert cached[0] == 0 and cached[1] == 0 and cached[3] == 0, cached
    assert cached[2] > 0, "the adapter's own namespace is reused"
    assert [first_a["model"], first_b["model"], base["model"]] == ["A", "B", "base"]
    serial = _complete(adapter_server.url, "B", prompt[:50], deterministic=True)  # the serial lane
    assert serial["choices"][0]["text"] == oracle_text(tiny_model_dirs["llama"], dora, prompt[:50])

    # The SSD tier files each entry under its adapter's identity; `mlxq cache ls` shows it.
    assert httpx.post(adapter_server.url + "/admin/cache/flush", timeout=60).status_code == 200
    listing = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "cache", "ls", str(adapter_server.ssd),
                              "--json"], capture_output=True, text=True, check=True)
    namespaces = {row["namespace"] for row in json.loads(listing.stdout)}
    assert {adapter_identity(lora), adapter_identity(dora), ""} <= namespaces


def test_models_are_listed_and_selected_by_every_protocol(adapter_server, tiny_model_dirs, adapter_dirs):
    url = adapter_server.url
    wait_drained(url)
    ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert ids == ["base", "A", "B"]
    assert httpx.get(url + "/v1/models/A").json()["parent"] == "base"
    stats = httpx.get(url + "/stats").json()
    assert stats["engine"]["warmed_up"]  # its steps ran base, mixed and one-adapter rows
    lora, dora = adapter_dirs["llama"]
    assert [(a["name"], a["kind"], a["namespace"]) for a in stats["model"]["adapters"]] == [
        ("A", "lora", adapter_identity(lora)), ("B", "dora", adapter_identity(dora))]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "model": "A"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "A"
    r = httpx.post(url + "/v1/messages", json={**chat, "model": "B"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "B"
    r = httpx.post(url + "/v1/responses", json={"input": "hello", "max_output_tokens": 8, "model": "A"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "A"

    r = httpx.post(url + "/v1/chat/completions", json={**chat, "model": "C"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'A'" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/messages", json={**chat, "model": "C"}, timeout=60)
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "model": "C"}, timeout=60)
    assert r.status_code == 404
    assert httpx.get(url + "/v1/models/C").status_code == 404


def test_an_adapter_for_another_model_stops_the_server_with_the_reason(tiny_model_dirs, tmp_path):
    # Made for the embedded default llama (hidden size 256), served on the tiny one (128).
    other = make_tiny_adapter(ensure_default_model(), tmp_path / "other", rank=4)
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(tiny_model_dirs["llama"]),
                           "--port", "0", "--adapter", f"other={other}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    output = proc.stderr + proc.stdout
    assert "--adapter other=" in output and "does not fit this model" in output
    assert "does not match model parameter shape" in output


@pytest.mark.parametrize(("flag", "message"), [
    ("x=/no/such/dir", "no such directory"),
    ("=/tmp", "NAME=PATH"),
    ("x", "NAME=PATH"),
])
def test_bad_adapter_flags_are_refused_before_loading(flag, message):
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--port", "0", "--adapter", flag],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_adapter_directory_problems_name_the_file(tmp_path, tiny_model_dirs):
    made = make_tiny_adapter(tiny_model_dirs["llama"], tmp_path / "a")
    (made / "adapters.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapters.safetensors is missing"):
        check_adapter_dir(AdapterSpec("a", made))
    config = json.loads((made / "adapter_config.json").read_text())
    (made / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "qlora"}))
    (made / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="fine_tune_type 'qlora' is not served"):
        check_adapter_dir(AdapterSpec("a", made))
