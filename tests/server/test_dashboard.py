"""/dashboard in headless Chromium: the page renders live numbers from /stats (screenshot kept)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
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


def element(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"no #{element_id} in the page"
    return match.group(1)


def keep_decoding(url: str, headers: dict, stop: threading.Event) -> None:
    """Streams long completions back to back until ``stop``: rows decode the whole time."""
    while not stop.is_set():
        with httpx.stream("POST", url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as reply:
            for _ in reply.iter_lines():
                if stop.is_set():
                    break


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_dashboard_renders_stats_in_a_real_browser(tiny_model_dirs, tmp_path):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--api-key", "k3y") as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                   headers={"Authorization": "Bearer k3y"})
        page = httpx.get(server.url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        url = server.url + "/dashboard#key=k3y"
        dom = chromium(url, tmp_path / "p1", "--dump-dom").stdout
        without_key = chromium(server.url + "/dashboard", tmp_path / "p3", "--dump-dom").stdout
        stop = threading.Event()
        decoding = threading.Thread(target=keep_decoding, args=(server.url, {"Authorization": "Bearer k3y"}, stop))
        decoding.start()
        try:
            live = chromium(url, tmp_path / "p4", "--dump-dom").stdout
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            chromium(url, tmp_path / "p2", f"--screenshot={shot}")
        finally:
            stop.set()
            decoding.join(60)
        server.stop()
        log = server.proc.stdout.read()
    assert 'id="status" class="ok">ok<' in dom
    assert "mlxq-tiny-llama" in dom
    assert 'id="rows">0<' in dom and 'id="mode">batch<' in dom
    assert 'id="done">1 / 0 / 0<' in dom
    assert 'id="ssd">off<' in dom and 'id="scheme">native<' in dom and 'id="shared">0<' in dom
    model_line = element(dom, "model")
    assert model_line.count("mlxq-tiny-llama") == 1 and "random weights" in model_line  # the name once
    # Bytes in decimal units, as the log prints them (GB = 10^9 bytes), never KiB/MiB/GiB.
    assert re.fullmatch(r"\d+(\.\d+)? (B|kB|MB|GB)", element(dom, "ram")), element(dom, "ram")
    assert "iB" not in dom
    logged_budget = re.search(r"KV budget: ([0-9.]+ GB)", log)
    assert logged_budget and element(dom, "budget") == logged_budget.group(1)  # the log's number, the log's unit
    # While a row decodes, the page reads a live token rate, and the chart says what it plots.
    assert int(element(live, "rows")) >= 1
    assert float(element(live, "tps")) > 0
    assert re.fullmatch(r"generated tokens/s over the last 2 minutes \(peak \d+\.\d tok/s\)",
                        element(live, "chart-scale"))
    assert shot.read_bytes()[:4] == b"\x89PNG"
    # Without the key the page loads but /stats is refused: it says so instead of showing numbers.
    assert "unreachable" in without_key or 'class="bad"' in without_key
