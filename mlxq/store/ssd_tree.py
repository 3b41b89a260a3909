"""The SSD tier's files as a tree in memory: which chain of node files serves a prompt.

Each ``.mlxkv`` file is a span of tokens that *forks* from its parent at a
token position inside the parent's chain (``start``): a file written after
its parent never copies the parent's tokens, and a split of a RAM node never
rewrites a file. A node's children are indexed by fork point, then by first
token, so a lookup walks the prompt one file at a time: its cost grows with
the prompt's length (and the few fork points per file), not with the number
of files.

Built from headers alone at start-up (store.ssd_store), kept in step with
every write and removal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxq.store.prefix_tree import chain_to, common_length

EMPTY = -1  # the child key of a span with no tokens (a snapshot at its fork point)


@dataclass(eq=False)
class FileNode:
    path: Path | None  # None for a namespace's root
    digest: str  # the file's name; "" for a root
    parent: FileNode | None
    start: int  # the fork point: tokens before the span
    tokens: tuple[int, ...]  # the span's own tokens
    nbytes: int  # file size
    mtime: float  # LRU order (a restore touches every file of its chain)
    trimmable: bool  # every layer is full attention
    snapshot: bool  # ring / recurrent state at the span's end is in the file
    namespace: str = ""
    # fork -> first token -> children: usually one; more where an entry shared too little of a file to
    # split it and holds those few tokens again (store.ssd_writes)
    children: dict[int, dict[int, list[FileNode]]] = field(default_factory=dict)
    in_tree: bool = True
    reads: int = 0  # restores that read this file since start-up

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def key(self) -> tuple[int, int]:
        return self.start, self.tokens[0] if self.tokens else EMPTY

    def chain(self) -> list[FileNode]:
        """The files from the first below the root down to this one."""
        return chain_to(self)

    def all_children(self) -> list[FileNode]:
        return [child for by_token in self.children.values() for kids in by_token.values() for child in kids]

    def subtree(self) -> list[FileNode]:
        """This node and every descendant, children after their parents."""
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.all_children())
        return out


def make_root(namespace: str) -> FileNode:
    return FileNode(None, "", None, 0, (), 0, 0.0, True, True, namespace)


def attach(parent: FileNode, child: FileNode) -> list[FileNode]:
    """Link ``child`` under ``parent``; the siblings already there with the same first token."""
    fork, first = child.key
    kids = parent.children.setdefault(fork, {}).setdefault(first, [])
    others = list(kids)
    kids.append(child)
    child.parent = parent
    return others


def detach(node: FileNode) -> None:
    fork, first = node.key
    by_token = node.parent.children.get(fork, {})
    kids = by_token.get(first, [])
    if node in kids:
        kids.remove(node)
        if not kids:
            del by_token[first]
        if not by_token:
            del node.parent.children[fork]
    node.in_tree = False


# Given a file and how far the prompt matches along it, the prompt tokens it serves (0: none).
Usable = Callable[[FileNode, int], int]


def served_by_any_prefix(node: FileNode, reach: int) -> int:
    """Full attention: every matched token is servable, even mid-file."""
    return reach


def served_at_snapshots(node: FileNode, reach: int) -> int:
    """Rings and recurrent state: only a whole span whose file holds the state at its end."""
    if node.trimmable:
        return reach
    return node.end if reach == node.end and node.snapshot else 0


@dataclass
class ChainMatch:
    chain: list[FileNode]  # root excluded; the last one serves the end
    n: int  # prompt tokens served


def search(root: FileNode, prompt: tuple[int, ...] | list[int], limit: int, usable: Usable) -> ChainMatch:
    """The chain serving the most of ``prompt[:limit]``. Explores every child that extends the match
    (usually one per file), so an unusable branch never hides a usable one."""
    best = ChainMatch([], 0)
    prompt = tuple(prompt)  # once: each candidate compares a slice of it (in C)
    stack: list[tuple[FileNode, int]] = [(root, 0)]  # (node, prompt tokens matched along its chain)
    while stack:
        node, pos = stack.pop()
        for fork, by_token in node.children.items():
            if fork > pos:
                continue
            for child in _candidates(by_token, prompt, fork, limit):
                reach = fork + _matched(child.tokens, prompt, fork, limit)
                if child.tokens and reach <= pos:
                    continue  # no progress past what the parent already matched
                if (n := usable(child, reach)) > best.n:
                    best = ChainMatch(child.chain(), n)
                stack.append((child, reach))
    return best


def _matched(span: tuple[int, ...], prompt: tuple[int, ...], fork: int, limit: int) -> int:
    """How many of ``span``'s tokens the prompt repeats from ``fork`` (at most to ``limit``)."""
    end = min(limit, fork + len(span))
    if prompt[fork:end] == span[: end - fork]:
        return end - fork  # the usual case: the whole span, one comparison
    return common_length(span, prompt[fork:end])


def _candidates(by_token: dict[int, list[FileNode]], prompt, fork: int, limit: int) -> list[FileNode]:
    out = list(by_token.get(EMPTY, ()))
    if fork < limit:
        out.extend(by_token.get(prompt[fork], ()))
    return out
