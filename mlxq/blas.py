"""Load an optimized BLAS into the process before MLX binds the reference one.

The Linux ``mlx[cpu]`` wheel links netlib's reference BLAS/LAPACK. Its
``cblas_sgemm`` runs ~4-8 GFLOP/s on this project's CI machine, while MKL or
OpenBLAS reach 150-230 GFLOP/s (docs/benchmarks.md). ``libmlx.so`` resolves
its BLAS symbols through the dynamic linker, and a library opened with
``RTLD_GLOBAL`` *before* ``libmlx.so`` is loaded sits ahead of the bundled
one in the global lookup scope. So all this module does is find a usable
library and ``dlopen`` it globally before the first ``import mlx``.

This module must not import mlx. ``mlxq/__init__.py`` calls :func:`activate`
first thing, so any ``import mlxq...`` gets the fast path.

Order of preference (``MLXQ_BLAS`` overrides it):
1. ``MLXQ_BLAS=/path/to/lib.so``: that file.
2. MKL's ``libmkl_rt`` from the ``mkl`` wheel (a Linux x86_64 dependency of
   mlxq, so a plain ``pip install`` gets it). Standard CBLAS symbols;
   fastest matrix-vector products here (the decode step's shape).
3. A system OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``, Fedora
   ``openblas``).
``MLXQ_BLAS=bundled`` keeps the wheel's reference BLAS.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from dataclasses import dataclass

# PyPI's scipy-openblas32/64 are not here on purpose: they export prefixed
# symbols (scipy_cblas_sgemm), so MLX would never call into them.
_SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
)

HOW_TO_GET_ONE = (
    "install one of: `pip install mkl` (x86_64), or the system package "
    "libopenblas0-pthread (Debian/Ubuntu) / openblas (Fedora); or point "
    "MLXQ_BLAS at a BLAS shared library with standard cblas_* symbols"
)


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU backend calls into in this process."""

    name: str  # "mkl", "openblas", "custom", "bundled-reference" or "not-applicable"
    path: str | None  # the library loaded, None when nothing was loaded
    reason: str  # one line for the start-up log and /stats

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "reason": self.reason}


_active: BlasInfo | None = None


def _mkl_candidates() -> list[str]:
    # The mkl wheel puts its libraries in <prefix>/lib, not in site-packages.
    prefixes = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    found: list[str] = []
    for prefix in sorted(prefixes):
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    return found


def _try_load(path: str) -> bool:
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True


def _choose() -> BlasInfo:
    override = os.environ.get("MLXQ_BLAS", "").strip()
    if override == "bundled":
        return BlasInfo("bundled-reference", None, "MLXQ_BLAS=bundled: reference BLAS kept")
    if sys.platform != "linux":
        # macOS uses Accelerate through MLX's Metal/CPU build; nothing to do.
        return BlasInfo("not-applicable", None, f"{sys.platform}: MLX's own BLAS")
    if "mlx.core" in sys.modules:
        return BlasInfo(
            "bundled-reference",
            None,
            "mlx was imported before mlxq, too late to load a faster BLAS; import mlxq first",
        )
    if override:
        if _try_load(override):
            return BlasInfo("custom", override, f"MLXQ_BLAS={override}")
        raise RuntimeError(f"MLXQ_BLAS={override!r} could not be loaded")
    if platform.machine() == "x86_64":
        for path in _mkl_candidates():
            if _try_load(path):
                return BlasInfo("mkl", path, "MKL from the mkl wheel")
    for path in _SYSTEM_OPENBLAS:
        if os.path.exists(path) and _try_load(path):
            return BlasInfo("openblas", path, "system OpenBLAS")
    return BlasInfo(
        "bundled-reference",
        None,
        "no optimized BLAS found, CPU matmuls run ~20x slower; " + HOW_TO_GET_ONE,
    )


def activate() -> BlasInfo:
    """Load the best BLAS once per process; later calls return the first answer."""
    global _active
    if _active is None:
        _active = _choose()
    return _active


def active() -> BlasInfo:
    return activate()
