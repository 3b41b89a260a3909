"""A blocking wake-up channel from rank 0 to the other ranks, so that idle ranks use no CPU.

MLX's ring backend polls while a collective waits (0.32.4: a rank waiting in an all_gather used most
of a core), so a rank left waiting in the next iteration's collective while the server has no work
burns CPU for as long as it idles. When every rank agrees the engine is idle (engine/lockstep.py),
the other ranks instead block in a read of this channel, and rank 0 writes one byte to each of them
when there is work again (or at its idle heartbeat, which keeps a lost rank detected): a plain TCP
connection per rank, over loopback when every rank runs on rank 0's host.

A rank that exits closes its end: the next wake-up (or wait) names it. Set-up is agreed over the
group: unless every rank connected and proved it holds rank 0's token, no rank uses the channel and
idle ranks wait in the collective as before (a warning says so).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from mlxq.distributed.channel import agree_min, share_bytes

log = logging.getLogger("mlxq.distributed")

WORK, HEARTBEAT = b"w", b"h"  # what rank 0 wakes the others for: it took work, or its idle heartbeat
CONNECT_TIMEOUT_S = 2.0  # per address a rank tries
SETUP_TIMEOUT_S = 15.0  # rank 0: for every other rank to connect
HELLO_TIMEOUT_S = 1.0  # rank 0: for one connection's hello (a silent stranger cannot hold up the others)
SILENCE_TIMEOUT_S = 30.0  # any other rank, asleep: rank 0's heartbeat comes at least every second


class RankLost(RuntimeError):
    """A rank's end of the wake channel closed: the process is gone."""


@dataclass
class WakeChannel:
    """Rank 0 holds one socket per other rank; every other rank, one socket to rank 0."""

    rank: int
    peers: dict[int, socket.socket] = field(default_factory=dict)

    def wake_all(self, work: bool) -> None:
        """Rank 0: let every other rank out of :meth:`wait`, saying whether it took ``work`` (first: has
        one of them closed its end?)."""
        readable = _readable(self.peers.values())
        for rank, sock in self.peers.items():
            if sock.fileno() in readable and not _recv_or_empty(sock):
                raise RankLost(f"rank {rank} is gone (its wake channel closed)")
        for rank, sock in self.peers.items():
            try:
                sock.sendall(WORK if work else HEARTBEAT)
            except OSError as exc:
                raise RankLost(f"rank {rank} is gone (its wake channel failed: {exc})") from None

    def wait(self) -> bool:
        """Any other rank: block (no CPU) until rank 0 wakes this rank; whether rank 0 took work."""
        try:
            byte = self.peers[0].recv(1)
        except TimeoutError:  # a host that died or a connection dropped on the way sends no close
            raise RankLost(f"rank 0 is gone (no word on its wake channel for {SILENCE_TIMEOUT_S:.0f} s)") from None
        except OSError:
            byte = b""
        if not byte:
            raise RankLost("rank 0 is gone (its wake channel closed)")
        return byte == WORK

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers.clear()


def _readable(socks) -> set[int]:
    """The descriptors among ``socks`` with something to read (poll: no limit on descriptor numbers)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN)
    return {fd for fd, _ in poller.poll(0)}


def _keep_alive(sock: socket.socket) -> socket.socket:
    """No delay for the one-byte wake-ups; keep-alive so that a silent peer's end is found out."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def _recv_or_empty(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1)
    except OSError:  # reset by a peer that died
        return b""


def open_wake_channel(group: Any, local: bool) -> WakeChannel | None:
    """Connect every other rank to rank 0 (a collective); None, on every rank, unless all of them did.

    ``local``: every rank runs on rank 0's host (rank 0 listens on loopback only)."""
    rank, size = group.rank(), group.size()
    listener = _listen(local) if rank == 0 else None
    hello = None
    if rank == 0:  # no listener: no hosts to try, and every rank goes on without the channel
        hosts = [] if listener is None else ["127.0.0.1"] if local else leader_addresses()
        port = 0 if listener is None else listener.getsockname()[1]
        hello = json.dumps({"hosts": hosts, "port": port, "token": secrets.token_hex(16)}).encode()
    offer = json.loads(share_bytes(group, hello))
    try:
        channel = _accept(listener, offer["token"], size) if rank == 0 else _connect(offer, rank)
    finally:
        if listener is not None:
            listener.close()
    if agree_min(group, 1 if channel is not None else 0) != 1:
        if channel is not None:
            channel.close()
        if rank == 0:
            log.warning("idle ranks wait in a collective, which polls: a rank could not reach rank 0 at %s "
                        "port %d", ", ".join(offer["hosts"]) or "(no listening socket)", offer["port"])
        return None
    return channel


def _listen(local: bool) -> socket.socket | None:
    try:
        return socket.create_server(("127.0.0.1" if local else "0.0.0.0", 0))
    except OSError as exc:
        log.warning("rank 0 cannot listen for its wake channel: %s", exc)
        return None


def _hello(token: str, rank: int) -> bytes:
    return json.dumps({"token": token, "rank": rank}).encode().ljust(128)


def _accept(listener: socket.socket | None, token: str, size: int) -> WakeChannel | None:
    if listener is None:
        return None
    channel = WakeChannel(0)
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while len(channel.peers) < size - 1 and (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError:
            continue
        try:
            sock.settimeout(min(HELLO_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
            rank = _claimed_rank(json.loads(_recv_exactly(sock, 128)), token, size)
        except (OSError, ValueError):
            rank = None
        if rank is None or rank in channel.peers:
            sock.close()  # not one of ours
            continue
        sock.settimeout(None)
        channel.peers[rank] = _keep_alive(sock)
    if len(channel.peers) < size - 1:
        channel.close()
        return None
    return channel


def _claimed_rank(claim: Any, token: str, size: int) -> int | None:
    """The rank a connection's hello claims, if it holds rank 0's token (else: not one of the ranks)."""
    if not isinstance(claim, dict) or not isinstance(claim.get("token"), str) or \
            not hmac.compare_digest(claim["token"], token):
        return None
    rank = claim.get("rank")
    return rank if isinstance(rank, int) and 0 < rank < size else None


def _connect(offer: dict, rank: int) -> WakeChannel | None:
    for host in offer["hosts"]:
        try:
            sock = socket.create_connection((host, offer["port"]), timeout=CONNECT_TIMEOUT_S)
            sock.sendall(_hello(offer["token"], rank))
        except OSError:
            continue
        sock.settimeout(SILENCE_TIMEOUT_S)
        return WakeChannel(rank, {0: _keep_alive(sock)})
    return None


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed before its hello")
        data += chunk
    return data


def leader_addresses() -> list[str]:
    """Where other hosts may reach rank 0: what the launcher was told it is, then what its name resolves to."""
    found = []
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile):
        try:
            with open(hostfile) as f:
                found += [entry.rsplit(":", 1)[0] for entry in json.load(f)[0]]  # ring: rank 0's "ip:port"s
        except (OSError, ValueError, IndexError, TypeError, AttributeError):
            pass
    found += [os.environ.get("NCCL_HOST_IP", ""), os.environ.get("MLX_JACCL_COORDINATOR", "").rsplit(":", 1)[0]]
    try:
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    found.append(socket.gethostname())
    return list(dict.fromkeys(host for host in found if host))
