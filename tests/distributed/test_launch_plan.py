"""distributed/launch.py's plan: each local rank's environment, as mlx.launch would set it."""

from __future__ import annotations

import json

import pytest

from mlxq.distributed.launch import plan_ranks


def test_ring_ranks_share_one_hostfile_and_the_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    ranks = plan_ranks(2, "ring", str(tmp_path))
    assert [r.env["MLX_RANK"] for r in ranks] == ["0", "1"]
    hosts = json.loads((tmp_path / "hosts.json").read_text())
    assert len(hosts) == 2 and len({h[0] for h in hosts}) == 2
    assert all(r.env["MLX_HOSTFILE"] == str(tmp_path / "hosts.json") for r in ranks)
    assert ranks[0].env["MKL_NUM_THREADS"] == "4"


def test_nccl_ranks_get_one_gpu_each(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    ranks = plan_ranks(3, "nccl", str(tmp_path))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["2", "3", "5"]
    assert len({r.env["NCCL_PORT"] for r in ranks}) == 1
    with pytest.raises(ValueError, match="4 ranks need 4 GPUs, one each; 3 visible"):
        plan_ranks(4, "nccl", str(tmp_path))
    with pytest.raises(ValueError, match="start other backends with mlx.launch"):
        plan_ranks(2, "jaccl", str(tmp_path))
