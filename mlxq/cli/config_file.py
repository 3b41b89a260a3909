"""`mlxq serve --config FILE.toml`: the same settings as the flags, in a file; flags win.

Keys are the flags' names without the leading ``--`` (``kv-budget = "8GB"``); ``kv_budget``
spelled with underscores is the same key. The file's values become the command's defaults
(click's ``default_map``), so a flag given on the command line overrides them, and so does an
environment variable a flag reads (``MLXQ_API_KEY``). An unknown key or a value of the wrong TOML
type is one line naming the file and the key, exit 2; a value of the right type that the flag
refuses (``batch = 0``) is the flag's own error, as on the command line.
"""

from __future__ import annotations

import difflib
import sys
import types
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import typer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "MLXQ_CONFIG"
_NOT_SETTINGS = ("config_file",)
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


class ConfigFileError(ValueError):
    """A config file the command cannot use; the message names the file (and the key)."""


def apply_config_file(ctx: typer.Context, path: Path | None, command: Callable) -> Path | None:
    """Body of an eager ``--config`` callback: the file's settings become ``command``'s defaults."""
    if path is None or ctx.resilient_parsing:
        return path
    try:
        ctx.default_map = {**(ctx.default_map or {}), **read_config_file(path, command, _flag_names(ctx))}
    except ConfigFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return path


def read_config_file(path: Path, command: Callable, flags: dict[str, str]) -> dict[str, object]:
    """``{parameter name: value}``; ``flags`` maps each long flag without its dashes to its parameter."""
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None
    hints = typing.get_type_hints(command)
    settings: dict[str, object] = {}
    for key, value in table.items():
        name = flags.get(key.replace("_", "-"))
        if name is None:
            raise ConfigFileError(f"{path}: unknown key {key!r}{_did_you_mean(key, flags)}")
        if name in settings:
            raise ConfigFileError(f"{path}: {key!r} sets --{name.replace('_', '-')} a second time")
        settings[name] = _checked(path, key, _bare(hints[name]), value)
    return settings


def _flag_names(ctx: typer.Context) -> dict[str, str]:
    """Every long flag without its dashes (``batch`` and ``decode-concurrency`` alike) -> parameter name."""
    return {opt[2:]: param.name for param in ctx.command.params if param.name not in _NOT_SETTINGS
            for opt in param.opts if opt.startswith("--")}


def _bare(hint) -> type:
    """``int | None`` -> ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _checked(path: Path, key: str, kind: type, value):
    """The value as the flag would take it; a TOML type the flag cannot mean is refused, not coerced."""
    if typing.get_origin(kind) is list:  # a repeatable flag (adapter = ["a=./a", "b=./b"])
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ConfigFileError(f"{path}: {key!r} must be a list of strings")
        return value
    kinds = _toml_kinds(kind)
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        wanted = _KIND_NAMES[str if str in kinds else float if float in kinds else kinds[0]]
        got = _KIND_NAMES.get(type(value), f"a TOML {type(value).__name__}")
        raise ConfigFileError(f"{path}: {key!r} must be {wanted}, got {got}")
    if isinstance(kind, type) and issubclass(kind, Enum):
        choices = [member.value for member in kind]
        if value.lower() not in choices:
            raise ConfigFileError(f"{path}: {key!r} must be one of {', '.join(choices)}; got {value!r}")
        return value.lower()
    return str(value) if str in kinds else value


def _toml_kinds(kind: type) -> tuple[type, ...]:
    """TOML value types that mean something to a parameter of this Python type."""
    if kind is bool:
        return (bool,)
    if kind is int:
        return (int,)
    if kind is float:
        return (int, float)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return (str,)
    return (str, int, float)  # strings; byte sizes may be written as plain numbers (prompt-cache = 0)


def _did_you_mean(key: str, flags: dict[str, str]) -> str:
    close = difflib.get_close_matches(key.replace("_", "-"), list(flags), n=1)
    return f" (did you mean {close[0]!r}?)" if close else " (keys are the flag names without --)"
