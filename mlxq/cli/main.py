"""`mlxq` entry point."""

from __future__ import annotations

import typer

from mlxq import __version__
from mlxq.cli import bench, cache, golden, model, serve

EXAMPLES = """Examples:

  mlxq model pull mlx-community/Qwen3-4B-4bit        # a real model
  mlxq serve --model mlx-community/Qwen3-4B-4bit
  mlxq --install-completion                          # tab completion
"""

app = typer.Typer(no_args_is_help=True, help="Serve MLX language models.", epilog=EXAMPLES)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"mlxq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Serve MLX language models."""
app.command("serve", epilog=serve.EXAMPLES)(serve.serve)
app.add_typer(model.app, name="model")
app.add_typer(golden.app, name="golden")
app.add_typer(bench.app, name="bench")
app.add_typer(cache.app, name="cache")


@app.command("version")
def version() -> None:
    """Print mlxq's version and the BLAS in use."""
    from mlxq.blas import active

    blas = active()
    typer.echo(f"mlxq {__version__} (BLAS: {blas.name} {blas.path or ''})".rstrip())


def main() -> None:
    app(prog_name="mlxq")  # `python -m mlxq.cli.main` too: completion scripts and usage lines name `mlxq`


if __name__ == "__main__":
    main()
