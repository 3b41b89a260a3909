"""`mlxq cache ls|verify|prune|flush`: the SSD tier's files, offline; durability, online."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated

import typer

from mlxq.cli.cache_files import CacheFile, scan_files
from mlxq.store.checkpoint_links import parse_link_name

app = typer.Typer(no_args_is_help=True, help="Inspect, verify and prune .mlxkv files; flush a live server.")

_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _row(item: CacheFile, root: Path, now: float) -> dict:
    h = item.header
    return {
        "file": str(item.path.relative_to(root)), "fingerprint": item.fingerprint,
        "namespace": h.identity.namespace if h else None, "model": h.model if h else None,
        "kv_scheme": h.identity.kv_scheme if h else None, "digest": h.digest if h else None,
        "parent": (h.parent or None) if h else None, "depth": item.depth,
        "start": h.start if h else None, "tokens": len(h.tokens) if h else None, "end": h.end if h else None,
        "trimmable": h.trimmable if h else None, "snapshot": h.snapshot if h else None, "bytes": item.bytes,
        "durable": item.problem is None, "age_s": round(now - item.mtime, 1), "problem": item.problem,
        "kind": "checkpoint" if item.is_checkpoint else "node", "rank": item.rank[0] if item.rank else None,
        "checkpoint": _checkpoint_fields(h.checkpoint) if item.is_checkpoint and h and h.checkpoint else None,
    }


def _checkpoint_fields(record: dict) -> dict:
    """A checkpoint's record as `cache ls` shows it: its request key digest, tokens emitted and prompt length."""
    return {"key": record.get("key"), "emitted_tokens": len(record.get("emitted", ())),
            "prompt_tokens": record.get("prompt_tokens")}


@app.command("ls")
def ls(
    directory: Annotated[Path, typer.Argument(help="The --ssd-cache directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per file, as a list.")] = False,
) -> None:
    """Show the tree of node files: each under its parent, with its span (start, tokens, end), bytes, age;
    then the generation checkpoints (request key digest, tokens emitted, age)."""
    now = time.time()
    rows = [_row(f, directory, now) for f in scan_files(directory)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console

    nodes = [r for r in rows if r["kind"] == "node"]
    Console(width=200).print(_node_table(directory, nodes))
    checkpoints = [r for r in rows if r["kind"] == "checkpoint"]
    if checkpoints:
        Console(width=200).print(_checkpoint_table(checkpoints))


def _checkpoint_table(rows: list[dict]):
    """One line per request key: its newest link's tokens, the chain's length, bytes and age."""
    from rich.table import Table

    chains: dict[str, list[dict]] = {}
    for r in rows:
        chains.setdefault(_request_key(r), []).append(r)
    table = Table(title=f"generation checkpoints: {len(chains)} requests, {len(rows)} files, "
                        f"{sum(r['bytes'] for r in rows) / 1e6:.1f} MB")
    for column in ("request key", "fingerprint", "model", "prompt", "emitted", "links", "MB", "age"):
        table.add_column(column, justify="left" if column in ("request key", "fingerprint", "model") else "right",
                         overflow="fold")
    for key, links in chains.items():
        newest = max(links, key=lambda r: r["end"] or 0)
        record = newest["checkpoint"] or {}
        table.add_row(key, newest["fingerprint"], newest["model"] or "", str(record.get("prompt_tokens", "")),
                      str(record.get("emitted_tokens", "")), str(len(links)),
                      f"{sum(r['bytes'] for r in links) / 1e6:.2f}", _age(min(r["age_s"] for r in links)))
        for r in links:
            if r["problem"]:
                table.add_row(f"[red]{Path(r['file']).name}: {r['problem']}[/]", *[""] * 7)
    return table


def _request_key(row: dict) -> str:
    """The request key a checkpoint file belongs to: its record's, else its name's (a write cut by a
    crash, ``<key>-<end>.mlxkv.tmp``, has no header but still belongs to its request)."""
    key = (row["checkpoint"] or {}).get("key")
    parsed = parse_link_name(Path(row["file"]).name.split(".")[0])
    return key or (parsed[0] if parsed else Path(row["file"]).stem)


def _node_table(directory: Path, rows: list[dict]):
    from rich.table import Table

    table = Table(title=f"{directory}: {len(rows)} files, {sum(r['bytes'] for r in rows) / 1e6:.1f} MB")
    for column in ("node", "fingerprint", "namespace", "model", "start", "tokens", "end", "MB", "age"):
        table.add_column(column, justify="right" if column in ("start", "tokens", "end", "MB", "age") else "left",
                         overflow="fold")
    for r in rows:
        name = "  " * r["depth"] + ("└ " if r["depth"] else "") + Path(r["file"]).name.split(".")[0][:12]
        table.add_row(name, r["fingerprint"], r["namespace"] or "", r["model"] or "",
                      *(str(r[k]) if r[k] is not None else "" for k in ("start", "tokens", "end")),
                      f"{r['bytes'] / 1e6:.2f}", _age(r["age_s"]))
        if r["problem"]:
            table.add_row("", f"[red]{r['problem']}[/]", *[""] * 7)
    return table


@app.command("verify")
def verify(
    directory: Annotated[Path, typer.Argument(help="The --ssd-cache directory.")],
    delete_bad: Annotated[bool, typer.Option(help="Remove each bad file (and the files below it).")] = False,
) -> None:
    """Check every header, every tensor checksum and every chain (a file whose parent is missing or bad is
    bad too). Exit 1 and name each bad file if any."""
    files = scan_files(directory, verify=True)
    bad = [f for f in files if f.problem]
    for item in bad:
        typer.echo(f"BAD {item.path}: {item.problem}")
        if delete_bad:
            item.path.unlink(missing_ok=True)
            typer.echo(f"    removed {item.path}")
    typer.echo(f"{len(files) - len(bad)} ok, {len(bad)} bad" + (" (removed)" if bad and delete_bad else ""))
    if bad:
        raise typer.Exit(1)


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", text.lower())
    if not match:
        raise typer.BadParameter(f"not a duration: {text!r} (examples: 90s, 30m, 12h, 7d)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


@app.command("prune")
def prune(
    directory: Annotated[Path, typer.Argument(help="The --ssd-cache directory.")],
    max_bytes: Annotated[str | None, typer.Option(help="Remove the least recently used files until the "
                                                       "directory holds at most this, e.g. 50GB.")] = None,
    older_than: Annotated[str | None, typer.Option(help="Remove files not used for this long, "
                                                        "e.g. 7d, 12h.")] = None,
    fingerprint: Annotated[str | None, typer.Option(help="Only this model fingerprint's files (alone: all "
                                                         "of them).")] = None,
    checkpoints: Annotated[bool, typer.Option(help="Only generation checkpoints (alone: all of them).")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print what would be removed; remove nothing.")] = False,
) -> None:
    """Remove entries by age, total size or model fingerprint (least recently used first); generation
    checkpoints are files of their own and go by the same rules (``--checkpoints``: only they). Tensor-parallel
    entries missing a rank's file (never restored) are removed by any prune."""
    from mlxq.cli.units import parse_bytes

    if max_bytes is None and older_than is None and fingerprint is None and not checkpoints:
        typer.echo("error: say what to prune: --max-bytes, --older-than, --fingerprint and/or --checkpoints",
                   err=True)
        raise typer.Exit(2)
    try:
        cap = parse_bytes(max_bytes) if max_bytes else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    now = time.time()
    files = scan_files(directory)
    candidates = {f for f in files if (fingerprint is None or f.fingerprint.split("-")[0] == fingerprint
                                       or f.fingerprint == fingerprint) and (f.is_checkpoint or not checkpoints)}
    doomed = _doomed(files, candidates, parse_duration(older_than) if older_than else None, cap, now)
    for f in doomed:
        typer.echo(f"{'would remove' if dry_run else 'removed'} {f.path} ({f.bytes / 1e6:.2f} MB, "
                   f"unused {_age(now - f.mtime)})")
        if not dry_run:
            f.path.unlink(missing_ok=True)
    freed = sum(f.bytes for f in doomed)
    typer.echo(f"{len(doomed)} files, {freed / 1e6:.1f} MB {'would be freed' if dry_run else 'freed'}")


def _doomed(files: list[CacheFile], candidates: set, older_than: float | None, cap: int | None,
            now: float) -> list[CacheFile]:
    """Whole subtrees only: a file goes only with every file below it, so no kept child loses its parent.

    A rank's file (tensor or pipeline parallel) whose entry is incomplete (another rank's file missing or
    bad, so never restored) goes in any case, and so does what is below it (bad too). By age: the
    candidate subtrees all of whose files are unused for ``older_than``; by size: least recently used
    candidate leaves, one at a time (a parent becomes a leaf when its last child goes).
    """
    doomed: list[CacheFile] = [f for f in files if f.rank is not None and f.problem and f in candidates]
    if older_than is not None:
        doomed += [f for f in files if all(x in candidates and now - x.mtime > older_than for x in f.subtree())]
    elif cap is None:
        doomed += [f for f in files if all(x in candidates for x in f.subtree())]  # --fingerprint alone
    if cap is not None:
        gone = set(doomed)
        total = sum(f.bytes for f in files if f not in gone)
        while total > cap:
            leaves = [f for f in candidates - gone if all(c in gone for c in f.children)]
            if not leaves:
                break
            victim = min(leaves, key=lambda f: f.mtime)
            gone.add(victim)
            doomed.append(victim)
            total -= victim.bytes
    return sorted(dict.fromkeys(doomed), key=lambda f: -f.depth)  # children before their parents


@app.command("flush")
def flush(
    url: Annotated[str, typer.Option(help="The server, e.g. http://127.0.0.1:8080.")] = "http://127.0.0.1:8080",
    api_key: Annotated[str | None, typer.Option(envvar="MLXQ_API_KEY", help="The server's --api-key.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for durability.")] = 300.0,
) -> None:
    """Ask a live server to put every dirty prefix on disk. Exit 0 when durable, 1 when not, 2 on error."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}/admin/cache/flush", params={"timeout": timeout}, headers=headers,
                       timeout=timeout + 10)
    except httpx.HTTPError as exc:
        typer.echo(f"error: could not reach {url}: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        body = r.json()
    except ValueError:
        body = {"error": r.text}
    typer.echo(json.dumps(body, indent=2))
    if r.status_code == 200 and body.get("durable"):
        return
    raise typer.Exit(1 if r.status_code == 503 else 2)
