"""/dashboard in headless Chromium: the page renders live numbers from /stats (screenshot kept)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess

ARTIFACTS = Path(os.environ.get("MLXQ_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=4000", "--window-size=1200,700"]


def chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url],
                          capture_output=True, text=True, timeout=90)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_dashboard_renders_stats_in_a_real_browser(tiny_model_dirs, tmp_path):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--api-key", "k3y") as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                   headers={"Authorization": "Bearer k3y"})
        page = httpx.get(server.url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        url = server.url + "/dashboard#key=k3y"
        dom = chromium(url, tmp_path / "p1", "--dump-dom").stdout
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        chromium(url, tmp_path / "p2", f"--screenshot={shot}")
        without_key = chromium(server.url + "/dashboard", tmp_path / "p3", "--dump-dom").stdout
    assert 'id="status" class="ok">ok<' in dom
    assert "mlxq-tiny-llama" in dom
    assert 'id="rows">0<' in dom and 'id="mode">batch<' in dom
    assert 'id="done">1 / 0 / 0<' in dom
    assert 'id="ssd">off<' in dom and 'id="scheme">native<' in dom and 'id="shared">0<' in dom
    assert shot.read_bytes()[:4] == b"\x89PNG"
    # Without the key the page loads but /stats is refused: it says so instead of showing numbers.
    assert "unreachable" in without_key or 'class="bad"' in without_key
