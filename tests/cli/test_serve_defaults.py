"""`mlxq serve`'s --shared-prefix-attention default: auto on one rank, off across several."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app


@pytest.fixture
def configs(monkeypatch):
    """The ServerConfig `mlxq serve` would run, instead of running it (as one rank of a world)."""
    import mlxq.distributed.world as world
    import mlxq.server.run as run

    seen = []
    monkeypatch.setattr(run, "serve", seen.append)
    monkeypatch.setattr(world, "launched_as_rank", lambda: True)
    return seen


@pytest.mark.parametrize("args, mode", [
    ([], "auto"),  # CUDA from the measured gate on; the CPU and Metal decline without probing the model
    (["--shared-prefix-attention", "off"], "off"),
    (["--shared-prefix-attention", "ON"], "on"),
    (["--tensor-parallel", "2"], "off"),  # every rank would check and group alone: not measured
    (["--tensor-parallel", "2", "--shared-prefix-attention", "auto"], "auto"),
])
def test_the_shared_prefix_default_is_auto_on_one_rank(configs, args, mode):
    result = CliRunner().invoke(app, ["serve", "--model", "some/model", *args])
    assert result.exit_code == 0, result.output
    (config,) = configs
    assert config.shared_prefix_attention == mode
