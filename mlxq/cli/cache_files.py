"""The SSD tier's files read offline for `mlxq cache`: headers, the tree they form, and what is unusable.

A node file is usable only through its whole chain: a file whose own header
or tensors are bad, or whose parent is missing, bad or does not hold its fork
point, is reported, and so is every file below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mlxq.store.ssd_config import CHECKPOINT_DIR, parse_rank_dir

if TYPE_CHECKING:
    from mlxq.store.mlxkv import EntryHeader


@dataclass(eq=False)
class CacheFile:
    path: Path
    fingerprint: str  # the directory name: <model fingerprint>-<kv scheme>
    bytes: int
    mtime: float
    header: EntryHeader | None = None  # when readable
    problem: str | None = None  # its own (header, tensors, name), or its chain's
    rank: tuple[int, int] | None = None  # (rank, size): one rank's shard of a tensor-parallel entry
    parent: CacheFile | None = None
    children: list[CacheFile] = field(default_factory=list)

    @property
    def is_checkpoint(self) -> bool:
        """A link of a generation checkpoint (DIR/<fingerprint>-<scheme>/checkpoints/<key>-<end>.mlxkv): in
        a chain of its request's links, in no prefix tree."""
        return self.path.parent.name == CHECKPOINT_DIR

    @property
    def depth(self) -> int:
        n, node = 0, self.parent
        while node is not None:
            n, node = n + 1, node.parent
        return n

    def subtree(self) -> list[CacheFile]:
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children)
        return out


def scan_files(directory: Path, *, verify: bool = False) -> list[CacheFile]:
    """Every ``.mlxkv`` (and leftover ``.tmp``) under any level of DIR/<fingerprint>-<scheme>/<namespace>/
    (or DIR/<fingerprint>-<scheme>/tp<N>-rank<r>/<namespace>/ for tensor-parallel ranks), linked into trees,
    parents before children."""
    if not directory.is_dir():
        typer.echo(f"error: {directory} is not a directory", err=True)
        raise typer.Exit(2)
    paths = sorted(p for p in directory.rglob("*.mlxkv*") if p.name.endswith((".mlxkv", ".mlxkv.tmp")))
    if not paths:
        typer.echo(f"note: no .mlxkv files under {directory} (the tree is "
                   "DIR/<fingerprint>-<kv scheme>/<namespace>/*.mlxkv)", err=True)
    files = [_read(path, verify) for path in paths]
    return _in_tree_order(_link(files))


def _entry_key(f: CacheFile) -> tuple:
    """What a rank file shares with the other ranks' files of its entry: all of its path but the rank
    (the rank folder's kind and size, tp2 or pp2, stay: tensor- and pipeline-parallel files never mix)."""
    return f.path.parent.parent.parent, f.rank[1], f.path.parent.parent.name.partition("-rank")[0], \
        f.path.parent.name, f.path.name


def _check_ranks(files: list[CacheFile]) -> None:
    """An entry of several ranks restores on every rank or on none: each rank's file is bad when another
    rank's is missing or bad itself."""
    entries: dict[tuple, dict[int, CacheFile]] = {}
    for f in files:
        if f.rank is not None and not f.is_checkpoint:
            entries.setdefault(_entry_key(f), {})[f.rank[0]] = f
    for (_, size, *_), ranks in entries.items():
        missing = [k for k in range(size) if k not in ranks]
        bad = [k for k, f in ranks.items() if f.problem]
        for f in ranks.values():
            if missing:
                f.problem = f.problem or f"rank {missing[0]}'s file is missing (an entry restores on every rank " \
                                         "or on none)"
            elif bad and f.rank[0] not in bad:
                f.problem = f"rank {bad[0]}'s file is bad (an entry restores on every rank or on none)"


def _read(path: Path, verify: bool) -> CacheFile:
    from mlxq.store.mlxkv import MlxkvError, read_header, verify_file

    st = path.stat()
    rank = parse_rank_dir(path.parent.parent.name)
    item = CacheFile(path, (path.parents[2] if rank else path.parent.parent).name, st.st_size, st.st_mtime,
                     rank=rank)
    if path.name.endswith(".tmp"):
        item.problem = "unfinished write (.tmp)"
        return item
    try:
        item.header = read_header(path)  # kept even when a tensor is bad: its children name it as their parent
        if verify:
            verify_file(path)
        if item.header.identity.directory != item.fingerprint:
            item.problem = f"header identity {item.header.identity.directory} is not its directory's"
        elif item.is_checkpoint and item.header.checkpoint is None:
            item.problem = "a node file among the checkpoints"
        elif item.header.digest != path.stem:  # the digest itself is checked along the chain
            item.problem = f"named {path.stem}, but its header's digest is {item.header.digest}"
    except (MlxkvError, OSError) as exc:
        item.problem = str(exc)
    return item


def _link(files: list[CacheFile]) -> list[CacheFile]:
    by_digest = {(f.path.parent, f.header.digest): f for f in files if f.header is not None}
    for f in files:
        h = f.header
        if h is None or not h.parent:
            continue
        parent = by_digest.get((f.path.parent, h.parent))
        if parent is None:
            f.problem = f.problem or f"its parent {h.parent} is missing (unreachable)"
            continue
        f.parent = parent
        parent.children.append(f)
        if parent.header.end != h.start:
            f.problem = f.problem or f"it starts at {h.start}, but its parent {h.parent} ends at {parent.header.end}"
    _check_ranks(files)
    for f in files:
        if f.parent is None:
            _propagate(f, None)
    return files


def _propagate(top: CacheFile, inherited: str | None) -> None:
    """Check each digest against the prefix its chain spells; a bad file's descendants are unreachable:
    each is reported, naming the file above it."""
    from mlxq.store.mlxkv import extend, prefix_hasher

    # a checkpoint link's digest names its request and end, not a prefix: its chain is checked by links only
    start = prefix_hasher() if top.header is not None and not top.header.parent and not top.is_checkpoint else None
    stack = [(top, inherited, start)]
    while stack:
        node, inherited, above = stack.pop()
        hasher = None
        if node.header is not None and above is not None:
            hasher = extend(above.copy(), node.header.tokens)
            if hasher.hexdigest() != node.header.digest and not node.problem:
                node.problem = "its digest does not name the prefix its chain spells"
        node.problem = node.problem or inherited
        passed = inherited or (f"a file above it is bad ({node.path.name})" if node.problem else None)
        stack.extend((child, passed, hasher) for child in node.children)


def _in_tree_order(files: list[CacheFile]) -> list[CacheFile]:
    out = []
    for f in files:
        if f.parent is None:
            out.extend(sorted(f.subtree(), key=lambda x: _chain_key(x)))
    return out


def _chain_key(f: CacheFile) -> tuple:
    """Sorts a tree depth-first: each file right after its parent, siblings by fork point."""
    chain, node = [], f
    while node is not None:
        h = node.header
        chain.append((h.start if h else 0, node.path.name))
        node = node.parent
    return tuple(chain[::-1])
