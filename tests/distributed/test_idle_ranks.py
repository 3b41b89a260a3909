"""Idle ranks under `--tensor-parallel 2` (CPU, ring over loopback) sleep in a blocking read of rank 0's wake
channel instead of a collective that polls: they use no CPU, wake for the next request, and a rank lost
while all of them sleep still ends the server (rank 0's idle heartbeat) or the other ranks (a closed channel)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from mlxq.bench.servers import cpu_seconds, free_port
from mlxq.distributed.wake import (
    HELLO_TIMEOUT_S,
    RankLost,
    WakeChannel,
    _accept,
    _hello,
    _recv_exactly,
    leader_addresses,
)
from mlxq.models.tiny import build_tiny_model
from tests.conftest import ServerProcess, wait_healthy

SERVE = ("--log-level", "warning", "--warmup", "off")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """The "default" size: 2 KV heads, one per rank."""
    return str(build_tiny_model("llama", tmp_path_factory.mktemp("tp-idle") / "llama", preset="default"))


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    """No shard() in mlx-lm, only pipeline()."""
    return str(build_tiny_model("qwen3_next", tmp_path_factory.mktemp("pp-idle") / "qwen3_next", preset="default"))


def _idle_then_wake(url: str) -> tuple[list[float], dict, list[str]]:
    """Each rank's idle CPU (share of one core over 3 s), /stats.distributed, and the texts before and after."""
    first = _complete(url, "Idle ranks")
    pids = [r["pid"] for r in httpx.get(f"{url}/stats", timeout=10).json()["distributed"]["ranks"]]
    time.sleep(1.0)
    before, started = [cpu_seconds(pid) for pid in pids], time.monotonic()
    time.sleep(3.0)
    share = [(cpu_seconds(pid) - b) / (time.monotonic() - started) for pid, b in zip(pids, before, strict=True)]
    stats = httpx.get(f"{url}/stats", timeout=10).json()["distributed"]
    print(f"idle CPU per rank (share of one core): {share}")
    return share, stats, [first, _complete(url, "wake up")]


@pytest.mark.slow  # samples idle CPU time for seconds: about 18 s
def test_idle_ranks_use_no_cpu_and_wake_for_the_next_request(llama):
    with ServerProcess("--model", llama, *SERVE) as one:
        alone = [_complete(one.url, p) for p in ("Idle ranks", "wake up")]
    with ServerProcess("--model", llama, "--tensor-parallel", "2", *SERVE) as two:
        share, stats, texts = _idle_then_wake(two.url)
        time.sleep(1.5)  # asleep again: SIGTERM wakes every rank to stop in order
        stopped = two.stop()
    assert stopped == 0
    # Waiting in the ring backend's collective, rank 1 used a whole core (docs/benchmarks.md).
    assert max(share) < 0.1
    assert stats["idle_wait"] == "wake channel" and stats["idle_sleeps"] >= 2
    assert texts == alone


@pytest.mark.slow  # samples idle CPU time of pipeline ranks for seconds: about 16 s
def test_idle_pipeline_ranks_sleep_too(qwen3_next):
    with ServerProcess("--model", qwen3_next, "--pipeline-parallel", "2", *SERVE) as two:
        share, stats, texts = _idle_then_wake(two.url)
        again = _complete(two.url, "Idle ranks")
    assert max(share) < 0.1
    assert stats["mode"] == "pipeline" and stats["idle_sleeps"] >= 2
    assert again == texts[0]


def _hand_started_ranks(model: str, hostfile, port: int) -> list[subprocess.Popen]:
    """Two ranks as mlx.launch starts them, with no launcher watching either."""
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", model, "--port", str(port),
               "--tensor-parallel", "2", *SERVE]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize(("killed", "message"), [
    (1, "rank 1 is gone"), pytest.param(0, "rank 0 is gone", marks=pytest.mark.slow)])
def test_a_rank_killed_while_every_rank_sleeps_ends_the_others(llama, tmp_path, killed, message):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    port = free_port()
    procs = _hand_started_ranks(llama, hostfile, port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120, proc=procs[0])
        _complete(f"http://127.0.0.1:{port}", "Idle ranks")
        time.sleep(1.5)  # every rank asleep
        procs[killed].kill()
        killed_at = time.monotonic()
        survivor = procs[1 - killed]
        code = survivor.wait(timeout=30)
        ended_after = time.monotonic() - killed_at
        output = survivor.stdout.read()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 1, output
    assert ended_after < 10  # rank 0's heartbeat (1 s), 2 s for errors to reach clients; rank 1 at once
    assert message in output, output


def test_rank_0_admits_only_connections_holding_its_token():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()
        stranger, rank1 = socket.create_connection(address), socket.create_connection(address)
        stranger.sendall(_hello("not the token", 1))
        rank1.sendall(_hello("token", 1))
        channel = _accept(listener, "token", size=2)
    assert channel is not None and list(channel.peers) == [1]
    assert stranger.recv(1) == b""  # closed by rank 0
    channel.wake_all(work=True)
    channel.wake_all(work=False)
    assert _recv_exactly(rank1, 2) == b"wh"
    rank1.close()
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        for _ in range(50):  # the close reaches rank 0's end
            channel.wake_all(work=False)
            time.sleep(0.01)
    channel.close()
    stranger.close()


def test_a_silent_stranger_does_not_hold_up_the_ranks_hello():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()
        silent = socket.create_connection(address)  # connects first, never says hello
        rank1 = socket.create_connection(address)
        rank1.sendall(_hello("token", 1))
        start = time.monotonic()
        channel = _accept(listener, "token", size=2)
        waited = time.monotonic() - start
    assert channel is not None and list(channel.peers) == [1]
    assert waited < HELLO_TIMEOUT_S + 1.0  # the stranger cost its hello timeout, not the whole set-up
    assert silent.recv(1) == b""  # and was closed
    channel.close()
    silent.close()
    rank1.close()


def test_a_rank_whose_rank_0_falls_silent_ends_instead_of_sleeping_forever():
    ours, rank0 = socket.socketpair()
    ours.settimeout(0.2)  # the silence allowed (30 s in service), short here
    channel = WakeChannel(1, {0: ours})
    rank0.sendall(b"w")
    assert channel.wait() is True
    with pytest.raises(RankLost, match="no word"):
        channel.wait()  # rank 0's host is gone: no close ever arrives
    channel.close()
    rank0.close()


def test_other_hosts_try_the_addresses_the_launcher_gave_rank_0_first(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.5:5000", "10.0.1.5:5001"], ["10.0.0.6:5002"]]))  # mlx.launch's ring
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    monkeypatch.setenv("NCCL_HOST_IP", "10.0.0.5")
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.2.5:6000")
    found = leader_addresses()
    assert found[:3] == ["10.0.0.5", "10.0.1.5", "10.0.2.5"]  # each once, in the launcher's order
    assert socket.gethostname() in found
