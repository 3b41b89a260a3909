"""`mlxq golden gen`: write oracle goldens from mlx-lm's own generation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Oracle goldens (mlx-lm is the reference).")


@app.command("gen")
def gen(
    suite: Annotated[str, typer.Option(help="Which suite: serial or batched.")] = "serial",
    out: Annotated[Path, typer.Option(help="Goldens root directory.")] = Path("goldens"),
    machine_specific: Annotated[bool, typer.Option(
        "--machine-specific", help="Write goldens/<machine>/ (an override for this machine only).")] = False,
) -> None:
    """Run mlx-lm on every tiny architecture and write the token ids."""
    from mlxq.golden.gen import SUITES, generate_goldens
    from mlxq.golden.store import machine_key

    if suite not in SUITES:
        typer.echo(f"error: unknown suite {suite!r} (available: {', '.join(SUITES)})", err=True)
        raise typer.Exit(2)
    path = generate_goldens(suite, out, machine=machine_key() if machine_specific else None)
    typer.echo(f"wrote {path}")
