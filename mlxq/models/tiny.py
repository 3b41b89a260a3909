"""The tiny-model factory: complete random-weight model directories, offline.

``build_tiny_model`` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with a chat template and EOS) and mlxq-model.json.
The parameter list comes from mlx-lm's own model class for the config, so
the directory loads through ``mlx_lm.load`` like any downloaded checkpoint.
``write_model_dir`` is the one writer of such directories (models/random_model.py
writes the same without weights).

Determinism: weights come from numpy's PCG64 seeded by (seed, parameter
name), the tokenizer from a fixed corpus; the same arguments give the same
bytes on every run and machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlxq.models.presets import make_config
from mlxq.models.tokenizer import EOS_TOKEN, write_tokenizer_files

# Bump when the bytes a given (arch, preset, seed) produce change.
FACTORY_VERSION = 1
MANIFEST = "mlxq-model.json"
Progress = Callable[[int, int], None]  # (parameters drawn, parameters in all)
WriteWeights = Callable[[Path, dict, dict], None]  # (folder, config, parameter name -> shape)


def param_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters mlx-lm's class for ``config`` expects."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Shapes only: mlx arrays are lazy, so nothing big is materialized here.
    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def _init_param(name: str, shape: tuple[int, ...], rng: np.random.Generator, unit_norm: float):
    if len(shape) == 1:
        if "norm" in name:
            # RMSNorm scales; gemma stores (scale - 1), hence unit_norm 0 there.
            return np.full(shape, unit_norm, dtype=np.float32)
        return np.zeros(shape, dtype=np.float32)  # biases, A_log, dt_bias
    fan_in = int(np.prod(shape[1:]))
    scale = np.float32(1.0 / np.sqrt(fan_in))
    return rng.standard_normal(shape, dtype=np.float32) * scale


def fast_param(name: str, shape: tuple[int, ...], key: list[int], unit_norm: float, dtype):
    """MLX's generator on the default device: seconds instead of minutes for 8B shapes.

    Deterministic for a given MLX version and device, but not the numpy bytes.
    """
    import mlx.core as mx

    if len(shape) == 1:
        return mx.full(shape, unit_norm if "norm" in name else 0.0, dtype=dtype)
    fan_in = int(np.prod(shape[1:]))
    seed = (key[0] * 1_000_003 + key[1] * 7919 + key[2]) % (1 << 63)
    return (mx.random.normal(shape, key=mx.random.key(seed)) * (1.0 / np.sqrt(fan_in))).astype(dtype)


def _write_weights(out: Path, config: dict, shapes: dict[str, tuple[int, ...]], seed: int,
                   fast_init: bool = False, progress: Progress | None = None) -> None:
    import mlx.core as mx

    total, done = sum(int(np.prod(s)) for s in shapes.values()), 0
    unit_norm = 0.0 if config["model_type"].startswith("gemma") else 1.0
    dtype = getattr(mx, config["torch_dtype"])
    weights = {}
    for name in sorted(shapes):
        # One generator per tensor: a tensor's bytes do not depend on the others.
        key = [seed, zlib.crc32(config["model_type"].encode()), zlib.crc32(name.encode())]
        if fast_init:
            weights[name] = fast_param(name, shapes[name], key, unit_norm, dtype)
            mx.eval(weights[name])  # bound the transient to one tensor
        else:
            rng = np.random.Generator(np.random.PCG64(key))
            weights[name] = mx.array(_init_param(name, shapes[name], rng, unit_norm)).astype(dtype)
        done += int(np.prod(shapes[name]))
        if progress is not None:
            progress(done, total)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def _check_target(out: Path, force: bool) -> None:
    """Refuse to write into a user's directory by mistake: only an empty one, an mlxq model, or --force."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory; pick another --out")
    if out.is_dir() and not force and read_manifest(out) is None and any(out.iterdir()):
        raise ValueError(f"{out} is not empty and holds no mlxq model; pick another --out, or pass --force "
                         "to write the model's files into it (nothing else in it is touched)")


def _install(tmp: Path, out: Path) -> None:
    """Move a finished build to ``out``. A new directory takes the build whole; an existing one gets
    the model's files replaced one by one (each an atomic rename), so nothing else in it is deleted."""
    if not out.exists():
        try:
            os.replace(tmp, out)
            out.chmod(0o755)  # mkdtemp made it private; a model directory is not a secret
            return
        except OSError:
            if not out.is_dir():
                raise
            # Another process made ``out`` meanwhile (ranks drawing one random model): file by file.
    for path in tmp.iterdir():
        os.replace(path, out / path.name)
    tmp.rmdir()


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_model_dir(out: Path, config: dict, manifest: dict, write_weights: WriteWeights | None = None) -> Path:
    """Build a model directory beside ``out`` and move it there (``_install``); on any error nothing is left.

    It holds the factory's tokenizer files, config.json (``config`` with the tokenizer's EOS ids),
    the weights when ``write_weights(folder, config, parameter shapes)`` is given (none: drawn at
    load), and the manifest (``manifest`` with the parameter count)."""
    shapes = param_shapes(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        ids = write_tokenizer_files(tmp, config["vocab_size"])
        config = {**config, "eos_token_id": [ids[EOS_TOKEN], ids["<|endoftext|>"]], "bos_token_id": None}
        _write_json(tmp / "config.json", config)
        if write_weights is not None:
            write_weights(tmp, config, shapes)
        _write_json(tmp / MANIFEST, {**manifest, "num_params": sum(int(np.prod(s)) for s in shapes.values())})
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def build_tiny_model(arch: str, out: str | Path, *, seed: int = 0, preset: str = "tiny",
                     fast_init: bool = False, force: bool = False, progress: Progress | None = None) -> Path:
    """Write a complete model directory to ``out`` and return it.

    ``out`` must be new, empty or an earlier mlxq model (its model files are replaced);
    ``force`` writes the model's files into any other directory, deleting nothing there.
    ``fast_init`` draws weights with MLX's generator on the default device (for
    real shapes on a GPU); the default numpy path gives the same bytes everywhere.
    ``progress(parameters drawn, parameters in all)`` is called after each weight tensor.
    """
    out = Path(out)
    config = make_config(arch, preset)
    _check_target(out, force)
    manifest = {
        "name": f"mlxq-{preset}-{arch}",
        "arch": arch,
        "preset": preset,
        "seed": seed,
        "init": "mlx" if fast_init else "numpy",
        "factory_version": FACTORY_VERSION,
        "note": "random weights built by mlxq's tiny-model factory; output is meaningless text",
    }
    return write_model_dir(out, config, manifest, lambda folder, with_eos, shapes: _write_weights(
        folder, with_eos, shapes, seed, fast_init, progress))


def read_manifest(model_dir: Path) -> dict | None:
    path = Path(model_dir) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None
