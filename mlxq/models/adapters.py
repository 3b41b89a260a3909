"""LoRA / DoRA adapters as mlx-lm writes them: a directory of ``adapter_config.json`` + ``adapters.safetensors``.

``check_adapter_dir`` validates a directory without MLX (the CLI runs it before
anything loads); ``read_adapter`` converts the model with mlx-lm's own
``load_adapters`` (so which layers an adapter touches, and every shape check,
are mlx-lm's), takes the low-rank pieces out of the converted layers and puts
the base layers back, leaving the model as it was. ``models/multi_lora.py``
then serves all adapters from one set of base weights.

An adapter's *identity* (``adapter-`` + a digest of its config and weights
files) names its prompt-cache namespace: a prompt cached under one adapter is
never reused under another, nor under the base model, and a renamed adapter
keeps its cache.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
KINDS = ("lora", "dora")  # mlx-lm's fine_tune_type values an adapter can have ("full" is a whole model)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class AdapterError(ValueError):
    """An adapter directory that cannot be served, with what is wrong."""


@dataclass(frozen=True)
class AdapterSpec:
    """One ``--adapter NAME=PATH``: the model id requests use, and an mlx-lm adapter directory."""

    name: str
    path: Path


@dataclass(frozen=True)
class AdapterInfo:
    """What the server and the engine know of a validated adapter."""

    name: str  # the model id a request selects it by
    path: Path
    kind: str  # "lora" or "dora"
    rank: int
    identity: str  # "adapter-<digest>": its prompt-cache namespace


@dataclass(frozen=True)
class LowRank:
    """One adapted linear layer of one adapter, as mlx-lm's LoRALinear / DoRALinear computes it."""

    lora_a: object  # mx.array [input_dims, rank]
    lora_b: object  # mx.array [rank, output_dims]
    scale: float
    gain: object | None  # DoRA only: m / |W + scale * B^T A^T| per output row, mx.array [output_dims]


def parse_adapter_flag(text: str) -> AdapterSpec:
    """``NAME=PATH`` -> AdapterSpec (the path is not checked here)."""
    name, sep, path = text.partition("=")
    name = name.strip()
    if not sep or not name or not path.strip():
        raise AdapterError(f"--adapter expects NAME=PATH (an mlx-lm adapter directory); got {text!r}")
    if not NAME_PATTERN.match(name):
        raise AdapterError(f"--adapter name {name!r}: use letters, digits and . _ : / - (at most 128)")
    return AdapterSpec(name, Path(path.strip()).expanduser())


def check_model_ids(names: Sequence[str], model_name: str = "") -> None:
    """AdapterError unless every adapter name is a model id of its own: none twice, none the base
    model's ``model_name`` (empty: not known yet, e.g. the CLI before the model is named)."""
    taken = {model_name} if model_name else set()
    for name in names:
        if name in taken:
            raise AdapterError(f"--adapter {name}: the name is already taken (by the base model or another "
                               "adapter); every model id must be unique")
        taken.add(name)


def check_adapter_dir(spec: AdapterSpec) -> AdapterInfo:
    """The directory's files and config, checked without loading MLX; raises AdapterError."""
    where = f"--adapter {spec.name}={spec.path}"
    if not spec.path.is_dir():
        raise AdapterError(f"{where}: no such directory")
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if not (spec.path / required).is_file():
            raise AdapterError(f"{where}: {required} is missing (an mlx-lm adapter directory holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((spec.path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in KINDS:
        raise AdapterError(f"{where}: fine_tune_type {kind!r} is not served (lora or dora; a 'full' "
                           "fine-tune is a model of its own: serve it with --model)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("rank"), int) or "scale" not in params:
        raise AdapterError(f"{where}: {CONFIG_FILE} needs lora_parameters with an integer 'rank' and a "
                           "'scale' (mlx-lm's names)")
    if not isinstance(config.get("num_layers"), int):
        raise AdapterError(f"{where}: {CONFIG_FILE} needs an integer num_layers")
    return AdapterInfo(spec.name, spec.path, kind, params["rank"], adapter_identity(spec.path))


def adapter_identity(path: Path) -> str:
    """``adapter-`` + sha256 over the config and the weights (16 hex digits): the cache namespace."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update(name.encode() + b"\0")
        with open(path / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"adapter-{digest.hexdigest()[:16]}"


def read_adapter(model, info: AdapterInfo) -> dict[str, LowRank]:
    """module path -> LowRank for every layer ``info`` adapts; the model is left unchanged.

    mlx-lm converts the layers and checks every tensor's name and shape against them
    (a wrong base model is a clear error here); only plain and quantized linear layers
    can be served per row (embeddings and mixture-of-experts layers are refused)."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import load_adapters

    where = f"--adapter {info.name}={info.path}"
    try:
        load_adapters(model, str(info.path))
    except (ValueError, KeyError, RuntimeError, OSError) as exc:  # mlx-lm's checks, an unreadable file
        _unconvert(model)  # a server loading one at run time goes on serving the model as it was
        raise AdapterError(f"{where}: does not fit this model: {exc}") from None
    converted = _unconvert(model)
    unsupported = sorted({type(m).__name__ for _, m in converted if type(m) not in (LoRALinear, DoRALinear)})
    if unsupported:
        raise AdapterError(f"{where}: adapts {', '.join(unsupported)} layers; only linear layers are served")
    if not converted:
        raise AdapterError(f"{where}: adapts no layer of this model")
    return {name: _low_rank(m, isinstance(m, DoRALinear)) for name, m in converted}


def _unconvert(model) -> list[tuple[str, object]]:
    """Put back the base layers of every layer mlx-lm converted; the converted ones (path, module)."""
    from mlx.utils import tree_unflatten

    converted = [(name, m) for name, m in model.named_modules() if type(m).__module__.startswith("mlx_lm.tuner")]
    if converted:
        model.update_modules(tree_unflatten([(name, _base_of(m)) for name, m in converted]))
    return converted


def _base_of(module):
    return module.linear if hasattr(module, "linear") else module.embedding


def _low_rank(module, dora: bool) -> LowRank:
    import mlx.core as mx

    gain = None
    if dora:  # DoRALinear.__call__'s magnitude over the adapted weight's row norms, computed once
        w = module._dequantized_weight()
        adapted = w + (module.scale * module.lora_b.T) @ module.lora_a.T
        gain = module.m / mx.linalg.norm(adapted, axis=1)
        mx.eval(gain)
    return LowRank(module.lora_a, module.lora_b, float(module.scale), gain)
