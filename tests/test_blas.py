"""The fast-BLAS loader, checked in fresh interpreters (it must run before mlx is imported)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = "import json, mlxq.blas as b; import mlx.core; print(json.dumps(b.active().as_dict()))"


def probe(code: str = PROBE, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="MKL wheel: Linux x86_64")
def test_mkl_from_the_wheel_is_loaded_by_default():
    info = probe(MLXQ_BLAS="")
    assert info["name"] == "mkl", info
    assert "libmkl_rt" in info["path"]


def test_bundled_can_be_forced():
    assert probe(MLXQ_BLAS="bundled")["name"] in {"bundled-reference", "not-applicable"}


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_importing_mlx_first_is_reported_not_hidden():
    info = probe("import mlx.core, json, mlxq.blas as b; print(json.dumps(b.active().as_dict()))", MLXQ_BLAS="")
    assert info["name"] == "bundled-reference"
    assert "import mlxq first" in info["reason"]


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_unloadable_override_is_an_error():
    proc = subprocess.run([sys.executable, "-c", "import mlxq"], capture_output=True, text=True,
                          env={**os.environ, "MLXQ_BLAS": "/nonexistent/libblas.so"})
    assert proc.returncode != 0 and "could not be loaded" in proc.stderr
