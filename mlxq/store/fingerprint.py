"""Which model and runtime a stored KV entry belongs to.

A cache entry is only valid for the exact weights, config and tokenizer that
produced it, computed by the same MLX build on the same kind of device (the
same weights give different KV bytes across MLX versions or backends, so a
runtime change must select another directory, not restore "nearly right"
state). The fingerprint hashes:

- config.json and the tokenizer files, byte for byte;
- for each weight shard: its name and the xxh3-128 of every byte. Sampling
  is not sound: two models can differ only outside the samples and would
  restore each other's KV. Hashing a 16 GB model takes seconds, so the digest
  is memoized in a small JSON file (``fingerprints.json`` in the SSD cache
  directory) keyed by the shard's real path, size, mtime_ns, ctime_ns and
  inode: a second start-up reads only ``stat``. Any write to the shard changes
  its ctime (which no user call can set back), so an edited shard is hashed
  again. In the Hugging Face cache a shard is a blob named by its content
  hash, and that name is used instead;
- the MLX version and the default device type.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

import mlx.core as mx
import xxhash

log = logging.getLogger("mlxq.ssd")

_CHUNK = 8 << 20
FINGERPRINT_MEMO = "fingerprints.json"  # beside the fingerprint directories of an SSD cache
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "chat_template.jinja")


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _full_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _shard_identity(path: Path, memo: dict) -> str:
    real = path.resolve()
    if real.parent.name == "blobs":  # HF cache: the blob's name is its content hash
        return real.name
    key = _stat_key(real.stat())
    known = memo.get(str(real))
    if known is None or known.get("stat") != key:
        log.info("hashing %s (%.1f MB) for the SSD cache's model identity", real, key[0] / 1e6)
        known = memo[str(real)] = {"stat": key, "xxh3_128": _full_digest(real)}
    return f"{key[0]}:{known['xxh3_128']}"


def _read_memo(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        memo = json.loads(path.read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: hash again


def _write_memo(path: Path | None, memo: dict) -> None:
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable directory costs a re-hash next time, nothing else
        log.warning("could not save the weight digests to %s: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_fingerprint(model_dir: Path, memo_path: Path | None = None) -> str:
    """A 16-hex-digit id of (weights, config, tokenizer, MLX runtime); shard digests memoized in ``memo_path``."""
    parts: dict[str, str] = {
        "config": file_digest(model_dir / "config.json"),
        "mlx": mx.__version__,
        "device": str(mx.default_device().type),
    }
    for name in _TOKENIZER_FILES:
        if (model_dir / name).exists():
            parts[f"tokenizer/{name}"] = file_digest(model_dir / name)
    memo = _read_memo(memo_path)
    before = json.dumps(memo, sort_keys=True)
    for shard in sorted(model_dir.glob("*.safetensors")):
        parts[f"weights/{shard.name}"] = _shard_identity(shard, memo)
    if json.dumps(memo, sort_keys=True) != before:
        _write_memo(memo_path, memo)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def namespace_dir(namespace: str) -> str:
    """Directory name of a namespace (any string, so hashed)."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]

