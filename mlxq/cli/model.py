"""`mlxq model ...`: build tiny random-weight models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mlxq.models.presets import ARCHS, SIZES

app = typer.Typer(no_args_is_help=True, help="Model utilities.")


@app.command("tiny")
def tiny(
    arch: Annotated[str, typer.Option(help=f"One of: {', '.join(ARCHS)}.")],
    out: Annotated[Path, typer.Option(help="Directory to write (replaced if it exists).")],
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
    preset: Annotated[str, typer.Option(help=f"Size: {', '.join(SIZES)}.")] = "tiny",
    fast_init: Annotated[bool, typer.Option(help="Draw weights with MLX on the default device (fast for "
                                                 "8B shapes on a GPU; not byte-identical across devices).")]
    = False,
) -> None:
    """Write a complete random-weight model directory, the same bytes every run."""
    from mlxq.models.tiny import build_tiny_model, read_manifest

    try:
        path = build_tiny_model(arch, out, seed=seed, preset=preset, fast_init=fast_init)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    manifest = read_manifest(path)
    typer.echo(f"{manifest['name']}: {manifest['num_params'] / 1e6:.2f}M parameters -> {path}")
