"""How an entry becomes node files: a new child, a split of a file it shares only part of, a snapshot added.

The SSD tree keeps the RAM tree's shape: forks happen only at the end of a
file, so every file on a chain is read whole and no prefix is held twice.
An entry that shares part of a file splits it, as the RAM tree splits a
node: the shared head is written as a new file (from the entry's own caches,
which hold it), then the file is rewritten without that head under the same
name (its digest names the prefix it ends, which has not changed, so the
files below it need no change), then the entry's own tokens are written
below the head. Each file is durable before the next one names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import replace

from mlxq.store.fingerprint import namespace_dir
from mlxq.store.mlxkv import MlxkvError, prefix_digest, read_arrays_steps
from mlxq.store.mlxkv import write_steps as mlxkv_write_steps
from mlxq.store.ssd_layers import head_layers, layer_bytes, tail_layers
from mlxq.store.ssd_tree import FileNode, attach, detach, search, served_by_any_prefix

Steps = Generator[None, None, FileNode]


def entry_steps(store, namespace: str, tokens: tuple[int, ...], caches_from: Callable[[int], list],
                trimmable: bool) -> Steps:
    """Write what the files lack of the entry ``tokens``; the node file that now ends it (None if the file
    it was to hang from was removed meanwhile)."""
    root = store.root_of(namespace)
    found = search(root, tokens, len(tokens), served_by_any_prefix)
    node, at = (found.chain[-1] if found.chain else root), found.n
    ends_here = at == len(tokens)
    if node is not root and at < node.end:
        if ends_here or worth_splitting(node, at):
            node = yield from split_steps(store, node, at, tokens, caches_from, snapshot=ends_here)
        else:
            node, at = node.parent, node.start  # hold the few shared tokens again, under the same parent
    if ends_here:
        if not node.snapshot:  # a file ends here already: it gains the snapshot
            yield from rewrite_steps(store, node, caches_from(node.start))
        return node
    start = node.end if node is not root else 0
    layers = head_layers(caches_from(start), len(tokens) - start, snapshot=True)
    child = FileNode(None, prefix_digest(tokens), node, start, tuple(tokens[start:]), 0, 0.0, trimmable, True,
                     namespace)
    yield from write_steps(store, child, layers)
    if node is not root and not node.in_tree:
        store.unlink(child.path, "the file above it was removed while it was written")
        return None
    attach(node, child)
    store.files[child.path] = child
    return child


# A split rewrites the whole file; holding a short shared head twice is cheaper. Split when the head is at
# least a fifth of the file (a system prompt under one agent's turn), or long in itself.
SPLIT_MIN_SHARE = 0.2
SPLIT_MIN_TOKENS = 256


def worth_splitting(node: FileNode, at: int) -> bool:
    head = at - node.start
    return head >= SPLIT_MIN_TOKENS or head >= SPLIT_MIN_SHARE * len(node.tokens)


def split_steps(store, node: FileNode, at: int, tokens: tuple[int, ...], caches_from, *, snapshot: bool) -> Steps:
    """Cut ``node`` at token ``at``: a new head file [node.start, at), ``node`` keeps the rest."""
    cut = at - node.start
    head = FileNode(None, prefix_digest(tokens[:at]), node.parent, node.start, node.tokens[:cut], 0, 0.0,
                    node.trimmable, snapshot, node.namespace)
    yield from write_steps(store, head, head_layers(caches_from(node.start), cut, snapshot=snapshot))
    try:
        header = store.checked_header(node)
        tensors = yield from read_arrays_steps(node.path, header)
    except (MlxkvError, OSError) as exc:
        head.path.unlink(missing_ok=True)
        store.discard(node, exc)
        raise OSError(f"could not split {node.path}: {exc}") from None
    tail = replace(node, parent=head, start=at, tokens=node.tokens[cut:], children={})
    try:
        yield from write_steps(store, tail, tail_layers(header.layers, tensors, cut))
    except OSError:
        head.path.unlink(missing_ok=True)  # the whole file is still in place
        raise
    detach(node)
    node.in_tree = True
    attach(head.parent, head)
    store.files[head.path] = head
    node.parent, node.start, node.tokens, node.nbytes, node.mtime = head, at, tail.tokens, tail.nbytes, tail.mtime
    attach(head, node)
    return head


def rewrite_steps(store, node: FileNode, caches: list) -> Steps:
    """Replace ``node``'s file with one holding the same span and the snapshot at its end."""
    done = replace(node, snapshot=True, children={})
    yield from write_steps(store, done, head_layers(caches, len(node.tokens), snapshot=True))
    node.snapshot, node.nbytes, node.mtime = True, done.nbytes, done.mtime
    return node


def write_steps(store, node: FileNode, layers: list) -> Generator[None, None, None]:
    """Write ``node``'s file (a new one, or in place of the old under the same name), one tensor per step;
    set its path, size and time (the caller puts it in the tree)."""
    nbytes = layer_bytes(layers)
    if store.max_bytes is not None and nbytes > store.max_bytes:
        raise OSError(f"a node of {nbytes} bytes exceeds --ssd-cache-max ({store.max_bytes} bytes)")
    directory = store.directory / namespace_dir(node.namespace)
    path = directory / f"{node.digest}.mlxkv"
    identity = store.identity
    header = {"fingerprint": identity.fingerprint, "kv_scheme": identity.kv_scheme, "namespace": node.namespace,
              "digest": node.digest, "parent": node.parent.digest, "start": node.start,
              "tokens": list(node.tokens), "trimmable": node.trimmable, "snapshot": node.snapshot,
              "created": time.time(), "model": store.model_name}
    directory.mkdir(parents=True, exist_ok=True)
    yield from mlxkv_write_steps(path, header, layers)
    st = path.stat()
    node.path, node.nbytes, node.mtime = path, st.st_size, st.st_mtime
    store.stats.writes += 1
    store.stats.written_bytes += st.st_size
