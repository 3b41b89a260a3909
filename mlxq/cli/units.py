"""Human byte sizes on the command line: 8GB, 512MiB, 1.5G, 1000000."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 8GB, 512MiB, 2G, 1000000)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"byte size must be > 0: {text!r}")
    return value


def flag_bytes(flag: str, text: str) -> int:
    """``parse_bytes`` for a command-line flag: an error names the flag."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
