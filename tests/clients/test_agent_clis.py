"""The real agent CLIs against a real `mlxq serve` on the embedded model: Claude Code (Messages),
Codex (Responses) and opencode (chat completions), each installed from npm and run on one
non-interactive prompt. Their text is gibberish (random weights); what is tested is that each
speaks its protocol to the end: exit 0, and the server answered its requests.

Slow (minutes on two CPU cores: Codex's first turn is ~21k prompt tokens) and it needs npm and
the registry, so it runs only with MLXQ_TEST_AGENT_CLIS=1; MLXQ_AGENT_CLIS=DIR reuses an install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MLXQ_TEST_AGENT_CLIS") != "1",
                       reason="installs three CLIs from npm and runs for minutes: set MLXQ_TEST_AGENT_CLIS=1"),
]
PACKAGES = ("@anthropic-ai/claude-code", "@openai/codex", "opencode-ai")
MODEL = "mlxq-default-llama"
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def clis(tmp_path_factory) -> Path:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed")
    root = Path(os.environ.get("MLXQ_AGENT_CLIS") or tmp_path_factory.mktemp("clis"))
    if not all((root / "node_modules" / ".bin" / name).exists() for name in ("claude", "codex", "opencode")):
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root), *PACKAGES],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"npm could not install the CLIs (no registry?): {done.stderr[-500:]}")
    return root / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def server(cache_dir):
    with ServerProcess(env={"MLXQ_CACHE_DIR": cache_dir}) as s:
        yield s


@pytest.fixture(scope="module")
def capped_server(cache_dir):
    """opencode sends no temperature: greedy decoding of random weights may never reach EOS within
    the 32000 tokens it asks for, so its replies are capped (they end with finish_reason length)."""
    with ServerProcess("--max-tokens-limit", "64", env={"MLXQ_CACHE_DIR": cache_dir}) as s:
        yield s


def _finished(server) -> int:
    return httpx.get(server.url + "/stats").json()["engine"]["requests_finished"]


def _run(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": str(cwd), "NO_COLOR": "1"}
    return subprocess.run(args, cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_claude_code(clis, server, tmp_path):
    """Claude Code's own defaults carry ~44k tokens of tools and prompt (minutes of CPU prefill);
    --bare, one tool and a short system prompt keep the same protocol in ~1k tokens."""
    before = _finished(server)
    done = _run([str(clis / "claude"), "-p", "Say hello", "--model", MODEL, "--max-turns", "1", "--bare",
                 "--tools", "Read", "--system-prompt", "Be brief."], tmp_path,
                {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused",
                 "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _finished(server) > before


def test_codex(clis, server, tmp_path):
    (tmp_path / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "mlxq"\n\n[model_providers.mlxq]\nname = "mlxq"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    before = _finished(server)
    done = _run([str(clis / "codex"), "exec", "--skip-git-repo-check", "Say hello"], tmp_path,
                {"CODEX_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _finished(server) > before


def test_opencode(clis, capped_server, tmp_path):
    server = capped_server
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "mlxq",
                "options": {"baseURL": f"{server.url}/v1", "apiKey": "unused"}, "models": {MODEL: {"name": MODEL}}}
    config = {"$schema": "https://opencode.ai/config.json", "provider": {"mlxq": provider},
              "model": f"mlxq/{MODEL}", "small_model": f"mlxq/{MODEL}"}
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    before = _finished(server)
    done = _run([str(clis / "opencode"), "run", "Say hello"], tmp_path, {})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _finished(server) > before
