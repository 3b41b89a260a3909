"""The SSD tree under faults, through real servers: kill -9 mid-write, a full disk."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlxq.golden.cases import LONG
from tests.conftest import ServerProcess
from tests.server.test_ssd_cache import cli, complete, stop

BASE = " ".join([LONG] * 3)


def turns(n: int, tag: str) -> list[str]:
    """Prompts that extend one another (each a next turn): child files of the ones before."""
    return [BASE + "".join(f" {tag} turn {i}: {LONG}" for i in range(k + 1)) for k in range(n)]


def stats(url: str) -> dict:
    return httpx.get(url + "/stats").json()["ssd_cache"]


def test_kill_9_during_tree_writes_restores_every_durable_chain(tiny_model_dirs, tmp_path):
    args = ("--model", str(tiny_model_dirs["llama"]), "--log-level", "warning", "--ssd-cache", str(tmp_path))
    durable, racing = turns(3, "a"), turns(12, "b")
    outputs = {}
    with ServerProcess(*args) as server:
        for prompt in durable:
            outputs[prompt] = complete(server.url, prompt)
        assert httpx.post(server.url + "/admin/cache/flush", timeout=120).json()["durable"]
        landed = _kill_during_a_write(server, racing, outputs, tmp_path)
    assert landed, "the kill did not land during a write"
    assert list(tmp_path.rglob("*.tmp"))
    with ServerProcess(*args) as server:
        at_start = stats(server.url)
        again = {prompt: complete(server.url, prompt) for prompt in outputs}
        after = stats(server.url)
    # A kill between a split's head and the rewrite of the split file leaves both: the head goes.
    assert at_start["reaped_tmp"] == 1 and at_start["corrupt_removed"] == 0 and at_start["orphans_removed"] == 0
    assert at_start["unfinished_splits_removed"] <= 1
    for prompt, first in outputs.items():
        assert again[prompt]["choices"][0]["text"] == first["choices"][0]["text"]
    for prompt in durable:  # flushed before the kill: the whole chain restores
        usage = again[prompt]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    assert after["corrupt_removed"] == 0 and after["restores"] >= len(durable)
    assert cli("cache", "verify", str(tmp_path)).returncode == 0


def _kill_during_a_write(server: ServerProcess, prompts: list[str], outputs: dict, root: Path) -> bool:
    """Send next turns one after another (each written behind it) and SIGKILL the server while a
    ``.tmp`` exists (stopped first, so the write cannot finish between the look and the kill)."""
    done = threading.Event()

    def load():
        for prompt in prompts:
            try:
                outputs[prompt] = complete(server.url, prompt)
            except (httpx.HTTPError, AssertionError):
                break  # the server is gone
        done.set()

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    landed = False
    while not done.is_set() and not landed:
        if any(p.name.endswith(".tmp") for p in root.rglob("*")):
            server.proc.send_signal(signal.SIGSTOP)  # freeze it, then make sure the write is still open
            _wait_stopped(server.proc.pid)
            landed = any(p.name.endswith(".tmp") for p in root.rglob("*"))
            server.proc.send_signal(signal.SIGKILL if landed else signal.SIGCONT)
    server.proc.wait(30)
    thread.join(120)
    return landed


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP lands asynchronously: until the process is in state T its writer may still rename a file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] in ("T", "t"):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs (root only); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Write zeros until the file system refuses: a full disk."""
    filler = directory / "filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        while True:  # the last, partial megabyte
            try:
                f.write(b"\0" * 4096)
            except OSError:
                break
    return filler


def test_a_full_disk_keeps_serving_from_ram_and_writes_resume_when_space_returns(tiny_model_dirs, small_disk):
    args = ("--model", str(tiny_model_dirs["llama"]), "--log-level", "warning", "--ssd-cache", str(small_disk))
    a, b, c = turns(3, "disk")
    server = ServerProcess(*args)
    with server:
        filler = fill(small_disk)
        first = complete(server.url, a)
        assert httpx.post(server.url + "/admin/cache/flush", timeout=60).status_code == 503  # not durable
        again = complete(server.url, a)  # served, from RAM
        complete(server.url, b)
        full = stats(server.url)
        os.unlink(filler)  # space returns
        complete(server.url, c)  # a new entry is written at once
        written = stats(server.url)
        flushed = httpx.post(server.url + "/admin/cache/flush", timeout=60)  # and the failed ones on flush
        stop(server)
    log = server.proc.stdout.read()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
    assert full["write_failures"] >= 2 and full["entries"] == 0
    assert log.count("SSD cache write failed") == 1 and "No space left on device" in log
    assert log.count("SSD cache writes succeed again") == 1
    assert written["writes"] >= 1 and flushed.status_code == 200 and flushed.json()["durable"]
    with ServerProcess(*args) as server:  # and everything restores after a restart
        restored = complete(server.url, c)
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] >= restored["usage"]["prompt_tokens"] - 1
