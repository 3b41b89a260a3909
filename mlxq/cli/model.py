"""`mlxq model ...`: build tiny random-weight models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mlxq.models.presets import ARCHS, SIZES

app = typer.Typer(no_args_is_help=True, help="Model utilities.")


@app.command("tiny", epilog="Examples:\n\n  mlxq model tiny --arch llama --out ./tiny-llama\n"
                            "  mlxq model tiny --arch llama --preset llama3-1b --out ./llama3-1b")
def tiny(
    arch: Annotated[str, typer.Option(help=f"One of: {', '.join(ARCHS)}.")],
    out: Annotated[Path, typer.Option(help="Directory to write: new, empty, or an earlier mlxq model.")],
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
    preset: Annotated[str, typer.Option(help=f"Size: {', '.join(SIZES)}.")] = "tiny",
    fast_init: Annotated[bool, typer.Option(help="Draw weights with MLX on the default device (fast for "
                                                 "8B shapes on a GPU; not byte-identical across devices).")]
    = False,
    force: Annotated[bool, typer.Option(help="Write into a non-empty directory that holds no mlxq model "
                                             "(the model's files are added; nothing there is deleted).")] = False,
) -> None:
    """Write a complete random-weight model directory, the same bytes every run."""
    from mlxq.cli.build_progress import build_progress
    from mlxq.models.tiny import build_tiny_model, read_manifest

    typer.echo(f"building mlxq-{preset}-{arch} in {out} ...", err=True)
    try:
        with build_progress(f"mlxq-{preset}-{arch}") as progress:
            path = build_tiny_model(arch, out, seed=seed, preset=preset, fast_init=fast_init, force=force,
                                    progress=progress)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    manifest = read_manifest(path)
    typer.echo(f"{manifest['name']}: {manifest['num_params'] / 1e6:.2f}M parameters -> {path}")


@app.command("pull", epilog="Examples:\n\n  mlxq model pull mlx-community/Qwen3-4B-4bit\n"
                            "  mlxq serve --model mlx-community/Qwen3-4B-4bit")
def pull(
    repo: Annotated[str, typer.Argument(help="A Hugging Face repo id, e.g. mlx-community/Qwen3-4B-4bit.")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit (default: main).")] = None,
) -> None:
    """Download a model into the Hugging Face cache, where `mlxq serve --model REPO` finds it."""
    from mlxq.models.pull import PullError, pull_model

    try:
        path = pull_model(repo, revision)
    except PullError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    typer.echo(f"{repo} -> {path}\nserve it with: mlxq serve --model {repo}")
