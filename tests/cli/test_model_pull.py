"""`mlxq model pull` against a local HTTP mirror of the Hugging Face hub (HF_ENDPOINT), then served."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxq.models.tiny import build_tiny_model
from tests.conftest import free_port, wait_healthy

REPO, SHA = "mirror-org/tiny-llama", "0123456789abcdef0123456789abcdef01234567"


def _hub_app(files: dict[str, bytes]) -> Starlette:
    """What a snapshot download asks: the repo's revision and file tree, then each file by revision."""

    async def info(request: Request):
        repo = f"{request.path_params['owner']}/{request.path_params['name']}"
        if repo != REPO:
            return JSONResponse({"error": "Repository not found"}, 404, headers={"X-Error-Code": "RepoNotFound"})
        return JSONResponse({"id": REPO, "sha": SHA, "siblings": [{"rfilename": f} for f in sorted(files)]})

    async def tree(request: Request):
        return JSONResponse([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                             for f, d in sorted(files.items())])

    async def resolve(request: Request):
        data = files.get(request.path_params["file"])
        if data is None:
            return JSONResponse({"error": "Entry not found"}, 404, headers={"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data))}
        return Response(b"" if request.method == "HEAD" else data, headers=headers)

    return Starlette(routes=[
        Route("/api/models/{owner}/{name}/revision/{rev}", info),
        Route("/api/models/{owner}/{name}/tree/{rev}", tree),
        Route("/{owner}/{name}/resolve/{rev}/{file:path}", resolve, methods=["GET", "HEAD"]),
    ])


@pytest.fixture
def hub(tmp_path):
    model = build_tiny_model("llama", tmp_path / "upstream")
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    files["README.md"] = b"not needed to serve"
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_hub_app(files), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", files
    server.should_exit = True
    thread.join(5)


def _env(tmp_path, endpoint: str) -> dict:
    return {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1"}


def test_pull_then_serve_offline(hub, tmp_path):
    endpoint, files = hub
    env = _env(tmp_path, endpoint)
    pulled = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "model", "pull", REPO],
                            capture_output=True, text=True, timeout=120, env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert f"mlxq serve --model {REPO}" in pulled.stdout
    path = pulled.stdout.split(" -> ")[1].splitlines()[0]
    assert (open(f"{path}/model.safetensors", "rb").read()) == files["model.safetensors"]
    assert not os.path.exists(f"{path}/README.md")  # only what a model directory needs

    port = free_port()
    serve_env = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing there: serving must not download
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", REPO, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=serve_env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": REPO, "prompt": "hello", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_pull_unknown_repo_is_a_clear_error(hub, tmp_path):
    endpoint, _ = hub
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "model", "pull", "mirror-org/absent"],
                          capture_output=True, text=True, timeout=120, env=_env(tmp_path, endpoint))
    assert proc.returncode == 2
    assert "no repo 'mirror-org/absent'" in proc.stderr


def test_serve_names_the_directory_of_a_weights_file(tmp_path):
    model = build_tiny_model("llama", tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(model / "model.safetensors")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pass the directory that holds it" in proc.stderr and str(model) in proc.stderr
