"""``restore_placement``: a restore test runs under both ways a restore reads (store/restore_reads.py): into
host arrays (CPU, Metal) and through MLX's loader with checksums on a pool (what CUDA runs), on this machine."""

from __future__ import annotations

import pytest

from mlxq.store import restore_reads, ssd_restore


@pytest.fixture(params=["host", "device"])
def restore_placement(request, monkeypatch):
    reads = {"host": restore_reads.HostRows, "device": restore_reads.DeviceLoads}[request.param]
    monkeypatch.setattr(ssd_restore, "placement", lambda: reads)
    return request.param
