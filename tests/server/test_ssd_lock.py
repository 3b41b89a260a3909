"""Two servers on one --ssd-cache directory: the second is refused, naming the first; kill -9 frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from mlxq.bench.servers import free_port
from mlxq.store.ssd_lock import SsdDirectoryBusy, SsdLock
from tests.conftest import ServerProcess


def _second_server(model, directory) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(model), "--port", str(free_port()),
           "--ssd-cache", str(directory)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_second_server_on_the_directory_is_refused_and_a_killed_holder_frees_it(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    with ServerProcess("--model", str(model), "--ssd-cache", str(tmp_path)) as first:
        refused = _second_server(model, tmp_path)
        assert refused.returncode == 2
        assert f"in use by another mlxq server (pid {first.proc.pid} " in refused.stderr, refused.stderr
        assert httpx.get(first.url + "/health").status_code == 200  # the holder is untouched
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
    assert (tmp_path / "server.lock").exists()  # a stale file: the kernel dropped the lock with the process
    with ServerProcess("--model", str(model), "--ssd-cache", str(tmp_path)) as again:
        assert str(again.proc.pid) in (tmp_path / "server.lock").read_text()


def test_release_frees_the_directory_and_other_directories_are_independent(tmp_path):
    held = SsdLock(tmp_path / "a").acquire()
    SsdLock(tmp_path / "b").acquire().release()  # another directory: no conflict
    with pytest.raises(SsdDirectoryBusy, match=f"pid {os.getpid()} "):
        SsdLock(tmp_path / "a").acquire()  # flock conflicts across open files, even in one process
    held.release()
    SsdLock(tmp_path / "a").acquire().release()
