"""`mlxq cache prune` beside a running server: its flush and its shutdown line count only files on disk."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
from typer.testing import CliRunner

from mlxq.cli.main import app
from mlxq.golden.cases import LONG
from tests.conftest import ServerProcess

SERVER_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "server-config.md"
# What docs/server-config.md says the tier writes: DIR/<fingerprint>-<kv scheme>/<namespace digest>/<digest>.mlxkv
DOCUMENTED_LAYOUT = re.compile(r"[0-9a-f]{16}-native/[0-9a-f]{16}/[0-9a-f]{32}\.mlxkv")


def flush(url: str) -> dict:
    done = CliRunner().invoke(app, ["cache", "flush", "--url", url])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


def test_flush_and_shutdown_stop_claiming_files_a_prune_removed(tiny_model_dirs, tmp_path):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--ssd-cache", str(tmp_path)) as server:
        for opening in ("First", "Second"):
            reply = httpx.post(server.url + "/v1/completions", timeout=120,
                               json={"prompt": f"{opening}: {LONG}", "max_tokens": 4})
            assert reply.status_code == 200, reply.text
        before = flush(server.url)
        assert before["durable"] is True and before["entries"] == 2
        files = [path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*.mlxkv")]
        assert len(files) == 2 and all(DOCUMENTED_LAYOUT.fullmatch(f) for f in files), files
        assert "`DIR/<fingerprint>-<kv scheme>/<namespace digest>/<digest>.mlxkv`" in \
            " ".join(SERVER_CONFIG.read_text().split())
        pruned = CliRunner().invoke(app, ["cache", "prune", str(tmp_path), "--max-bytes", "1"])
        assert pruned.exit_code == 0 and "2 files" in pruned.output, pruned.output
        after = flush(server.url)
        assert after["entries"] == 0 and after["longest_durable_prefix_tokens"] == 0
        assert httpx.get(server.url + "/stats").json()["ssd_cache"]["entries"] == 0
        # The server still serves these prompts (from RAM) and writes nothing back the operator removed.
        again = httpx.post(server.url + "/v1/completions", json={"prompt": f"First: {LONG}", "max_tokens": 4})
        assert again.status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        log = server.proc.stdout.read()
    assert "2 files were removed by another process" in log
    assert "SSD cache durable at shutdown: 0 entries, longest prefix 0 tokens" in log
    assert not list(tmp_path.rglob("*.mlxkv"))
