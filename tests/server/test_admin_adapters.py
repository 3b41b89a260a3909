"""Adapters loaded and unloaded at run time (POST / DELETE /admin/adapters) through a real server."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from mlxq.golden.cases import LONG
from mlxq.models.adapters import adapter_identity
from mlxq.models.default import ensure_default_model
from mlxq.models.tiny import build_tiny_model
from mlxq.models.tiny_adapter import make_tiny_adapter
from tests.conftest import ServerProcess
from tests.server.test_adapters import MAX_TOKENS, oracle_text

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-adapters")
    llama = tiny_model_dirs["llama"]
    return {"lora": make_tiny_adapter(llama, root / "lora", seed=21, rank=4),
            "dora": make_tiny_adapter(llama, root / "dora", seed=22, rank=8, kind="dora",
                                      keys=["self_attn.q_proj", "mlp.down_proj"]),
            "other": make_tiny_adapter(ensure_default_model(), root / "other", rank=4)}  # another model's shapes


def load(url: str, name: str, path, headers=AUTH) -> httpx.Response:
    return httpx.post(url + "/admin/adapters", json={"name": name, "path": str(path)}, headers=headers, timeout=120)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.delete(url + f"/admin/adapters/{name}", headers=AUTH, timeout=120)


def complete(url: str, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, **fields})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def served(url: str) -> tuple[list[str], list[str]]:
    """(/v1/models ids, /stats model.adapters names)."""
    ids = [m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]]
    stats = httpx.get(url + "/stats", headers=AUTH).json()["model"]["adapters"]
    return ids, [a["name"] for a in stats]


@pytest.mark.parametrize("batch", ["1", "4"])
def test_an_adapter_loaded_at_run_time_serves_its_oracle_and_unloads(tiny_model_dirs, adapters, load_tiny, batch):
    model_dir = tiny_model_dirs["llama"]
    prompt = load_tiny("llama")[1].encode(LONG)[:40]
    with ServerProcess("--model", str(model_dir), "--served-model-name", "base", "--batch", batch,
                       "--api-key", KEY, "--log-level", "warning") as server:
        url = server.url
        assert load(url, "A", adapters["lora"], headers={}).status_code == 401
        loaded = load(url, "A", adapters["lora"])
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["namespace"] == adapter_identity(adapters["lora"])
        assert served(url) == (["base", "A"], ["A"])
        assert text_of(complete(url, "A", prompt)) == oracle_text(model_dir, adapters["lora"], prompt)
        assert text_of(complete(url, "base", prompt)) == oracle_text(model_dir, None, prompt)

        assert load(url, "A", adapters["dora"]).json()["error"]["code"] == "model_exists"
        assert load(url, "base", adapters["dora"]).status_code == 409
        misfit = load(url, "B", adapters["other"])  # mlx-lm's shape checks refuse it; A stays as it was
        assert misfit.status_code == 400 and "does not fit this model" in misfit.json()["error"]["message"]
        assert served(url) == (["base", "A"], ["A"])
        assert text_of(complete(url, "A", prompt)) == oracle_text(model_dir, adapters["lora"], prompt)

        assert unload(url, "A").json() == {"id": "A", "object": "model", "deleted": True}
        after = complete(url, "A", prompt)
        assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
        assert served(url) == (["base"], [])
        assert unload(url, "A").status_code == 404

        # The name again, on other weights: its own namespace, never the prompt cached under the first.
        assert load(url, "A", adapters["dora"]).status_code == 200
        again = complete(url, "A", prompt)
        assert text_of(again) == oracle_text(model_dir, adapters["dora"], prompt)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("body, message", [
    ({"name": "x", "path": "/no/such/dir"}, "no such directory"),
    ({"name": "", "path": "/tmp"}, "'name'"),
    ({"name": "x"}, "'path'"),
    ({"name": "x", "path": "/tmp", "rank": 4}, "unknown field"),
    (["x"], "JSON object"),
])
def test_bad_load_requests_are_400_in_openai_shape(llama_server, body, message):
    r = httpx.post(llama_server.url + "/admin/adapters", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow  # waits out a long request on two servers: about 25 s on two cores
def test_an_adapter_with_a_running_request_is_not_unloaded(tiny_model_dirs, adapters, load_tiny):
    """The unload is refused while a row runs on the adapter; the row finishes exactly as it would have."""
    prompt = load_tiny("llama")[1].encode(LONG)[:30]
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--batch", "4", "--api-key", KEY,
                       "--log-level", "warning") as server:
        url = server.url
        assert load(url, "A", adapters["lora"]).status_code == 200
        reference = text_of(complete(url, "A", prompt, 1500, ignore_eos=True))
        started, result = threading.Event(), {}

        def run() -> None:
            with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=300, json={
                    "model": "A", "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "stream": True,
                    "temperature": 0}) as r:
                lines = []
                for line in r.iter_lines():
                    started.set()
                    lines.append(line)
                result["lines"] = lines

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(60)
        refused = unload(url, "A")
        thread.join(300)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_in_use", refused.text
        chunks = [json.loads(line[6:]) for line in result["lines"] if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference
        assert unload(url, "A").status_code == 200


def test_ranks_serving_together_refuse_runtime_adapters(tmp_path, adapters):
    """Under --tensor-parallel the ranks would have to swap an adapter between the same steps: a clear 409."""
    model = build_tiny_model("llama", tmp_path / "m", preset="default")  # heads that split in two
    with ServerProcess("--model", str(model), "--tensor-parallel", "2", "--warmup", "off",
                       "--log-level", "warning") as server:
        loaded = httpx.post(server.url + "/admin/adapters", json={"name": "A", "path": str(adapters["lora"])},
                            timeout=60)
        unloaded = httpx.delete(server.url + "/admin/adapters/A", timeout=60)
    assert loaded.status_code == 409 and loaded.json()["error"]["code"] == "unsupported"
    assert "--tensor-parallel" in loaded.json()["error"]["message"]
    assert unloaded.status_code == 409
