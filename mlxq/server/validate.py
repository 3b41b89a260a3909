"""Typed field readers for JSON request bodies: a wrong value is a 400 naming its field."""

from __future__ import annotations

from mlxq.server.errors import invalid

_MISSING = object()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_number(body: dict, name: str, default, *, lo=None, hi=None) -> float:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not _is_number(value):
        raise invalid(f"'{name}' must be a number, got {type(value).__name__}", name)
    if value != value or value in (float("inf"), float("-inf")):
        raise invalid(f"'{name}' must be finite", name)
    _check_range(name, value, lo, hi)
    return float(value)


def read_int(body: dict, name: str, default, *, lo=None, hi=None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type: 1.0 is a fine way to write 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer, got {type(value).__name__}", name)
    _check_range(name, value, lo, hi)
    return value


def read_bool(body: dict, name: str, default: bool) -> bool:
    return _read_instance(body, name, default, bool, "a boolean")


def read_str(body: dict, name: str, default):
    return _read_instance(body, name, default, str, "a string")


def _read_instance(body: dict, name: str, default, kind: type, what: str):
    value = body.get(name)
    if value is None:  # absent, or JSON null
        return default
    if not isinstance(value, kind):
        raise invalid(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def read_dict(body: dict, name: str):
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise invalid(f"'{name}' must be an object, got {type(value).__name__}", name)
    return value


def read_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(stop) > 16:
        raise invalid("'stop' accepts at most 16 strings", "stop")
    return tuple(s for s in stop if s)


def _check_range(name: str, value, lo, hi) -> None:
    if lo is not None and value < lo:
        raise invalid(f"'{name}' must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be <= {hi}, got {value}", name)
