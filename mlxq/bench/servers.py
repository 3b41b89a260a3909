"""Start `mlxq serve` as a child process for benchmarks that bring their own server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (Linux: /proc/PID/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: stat(5) fields 14, 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Wait until ``url``/health answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


class ServeProcess:
    """`mlxq serve ARGS` on a free loopback port; a context manager that waits for /health."""

    def __init__(self, *args: str, log_path: str | None = None, timeout_s: float = 300, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self._timeout = timeout_s
        cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--port", str(self.port), "--log-level", "warning",
               *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})

    def __enter__(self) -> ServeProcess:
        try:
            wait_healthy(self.url, self.proc, self._timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
