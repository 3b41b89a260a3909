"""Every adapter is a model id of its own: a name given twice, or the base model's name, is refused the same
way on every path that installs adapters (one process, tensor-parallel ranks, pipeline ranks) and by the CLI
before anything loads, with or without --tensor-parallel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxq.models.adapters import AdapterError, AdapterSpec
from mlxq.models.loader import load_model
from mlxq.models.multi_lora import MultiLoRALinear, attach_adapters
from mlxq.models.pipeline_lora import install_pipeline_adapters, read_whole_adapters
from mlxq.models.sharded_lora import install_sharded_adapters, read_full_adapters
from mlxq.models.tiny_adapter import make_tiny_adapter

TAKEN = "the name is already taken (by the base model or another adapter); every model id must be unique"


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dirs, tmp_path_factory):
    return make_tiny_adapter(tiny_model_dirs["llama"], tmp_path_factory.mktemp("names") / "a", seed=3, rank=4)


def _one_process(loaded, specs):
    attach_adapters(loaded, specs)


def _tensor_ranks(loaded, specs):
    infos, pieces = read_full_adapters(loaded.model, specs)
    install_sharded_adapters(loaded.model, infos, pieces, None, loaded.name)  # refused before any collective


def _pipeline_ranks(loaded, specs):
    infos, pieces = read_whole_adapters(loaded.model, specs, 1)
    install_pipeline_adapters(loaded.model, infos, pieces, loaded.name)


@pytest.mark.parametrize("install", [_one_process, _tensor_ranks, _pipeline_ranks])
@pytest.mark.parametrize(("names", "refused"), [(["a", "b", "a"], "a"), (["a", "base"], "base")])
def test_a_taken_adapter_name_is_refused_on_every_install_path(install, names, refused, tiny_model_dirs,
                                                                 adapter_dir):
    loaded = load_model(str(tiny_model_dirs["llama"]), name="base")
    with pytest.raises(AdapterError) as refusal:
        install(loaded, [AdapterSpec(name, adapter_dir) for name in names])
    assert str(refusal.value) == f"--adapter {refused}: {TAKEN}"
    assert not any(isinstance(m, MultiLoRALinear) for _, m in loaded.model.named_modules())
    assert loaded.adapters == {}


@pytest.mark.parametrize("parallel", [(), ("--tensor-parallel", "2")])
@pytest.mark.parametrize(("flags", "refused"), [(["a", "a"], "a"), (["base"], "base")])
def test_the_cli_refuses_a_taken_adapter_name_before_loading(parallel, flags, refused, adapter_dir):
    adapters = [arg for name in flags for arg in ("--adapter", f"{name}={adapter_dir}")]
    done = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--port", "0", "--served-model-name",
                           "base", *parallel, *adapters], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: --adapter {refused}: {TAKEN}"
