"""Shared fixtures: tiny models on disk, and real mlxq servers on loopback ports."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import mlxq  # noqa: F401  (first: loads the fast BLAS before anything imports mlx)
from mlxq.bench.servers import free_port
from mlxq.golden.cases import ARCHS
from mlxq.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_dirs(model_root) -> dict[str, Path]:
    """Every tiny architecture, built once per test session."""
    return {arch: build_tiny_model(arch, model_root / arch) for arch in ARCHS}


_loaded_cache: dict[str, object] = {}


@pytest.fixture(scope="session")
def load_tiny(tiny_model_dirs):
    """arch -> (model, tokenizer), loaded once through mlx-lm."""
    import mlx_lm

    def load(arch: str):
        if arch not in _loaded_cache:
            _loaded_cache[arch] = mlx_lm.load(str(tiny_model_dirs[arch]))
        return _loaded_cache[arch]

    return load


def wait_healthy(base_url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become healthy in {timeout}s")


class ServerProcess:
    """`mlxq serve` as a real child process on a free loopback port."""

    def __init__(self, *args: str, env: dict | None = None, wrap: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*wrap, sys.executable, "-m", "mlxq.cli.main", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})},
        )

    def __enter__(self):
        try:
            wait_healthy(self.url, proc=self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture(scope="session")
def llama_server(tiny_model_dirs):
    """One shared server on the tiny llama for read-mostly API tests."""
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-level", "warning") as server:
        yield server


class InProcessServer:
    """uvicorn in a thread around a ServerState the test built (for engine-level fault tests)."""

    def __init__(self, state):
        import uvicorn

        from mlxq.server.app import build_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = state
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
