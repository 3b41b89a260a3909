"""A generation checkpoint as a chain of links: what each link file holds, and how a chain becomes caches.

A request's checkpoint is not one file but a chain (docs/mlxkv-format.md,
"Generation checkpoints"): each link ``<key>-<end>.mlxkv`` holds the
full-attention KV of the tokens ``[start, end)`` only, the span generated
since the link before it (``<key>-<start>``; the first link starts at 0),
and the whole state of every ring and recurrent layer at ``end`` (small,
and not cut along tokens). So a row that publishes every ``interval``
tokens writes each token's KV once, and a generation's bytes grow linearly
with its length.

Restoring walks the newest link's parents down to the first one and joins
their spans along the token axis; any missing or bad link makes the whole
chain a miss, never a partial restore.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxq.store.layer_codec import MlxkvError, decode_layer

RECORD_VERSION = 2
SPAN_KINDS = ("kv", "qkv")  # cut along tokens: a link holds its own span of them; the others are whole


@dataclass(frozen=True)
class CheckpointRecord:
    """The header's ``checkpoint`` record: where a generation stood when its caches were taken."""

    key: str  # the request key's digest (the files' name stem)
    prompt_tokens: int  # the prompt's length; the chain's caches cover prompt + emitted
    emitted: tuple[int, ...]  # tokens generated before ``pending`` (EOS never among them)
    pending: int  # the next token, sampled but not handed out (fed to the caches next)
    rng_key: tuple[int, ...] | None  # MLX's global key before the draw after ``pending`` (seeded rows)
    created: float = 0.0  # unix time

    @property
    def end(self) -> int:
        """Tokens the caches cover: the prompt and every emitted token."""
        return self.prompt_tokens + len(self.emitted)

    def as_header(self) -> dict:
        # Field by field: dataclasses.asdict walks every emitted token (~1.7 ms for 1,000 of them, on the
        # engine thread at every batch publish).
        return {"key": self.key, "prompt_tokens": self.prompt_tokens, "emitted": self.emitted,
                "pending": self.pending, "rng_key": self.rng_key, "created": self.created, "version": RECORD_VERSION}

    @classmethod
    def from_header(cls, record: dict) -> CheckpointRecord:
        if record.get("version") != RECORD_VERSION:
            raise MlxkvError(f"checkpoint record version {record.get('version')!r}")
        try:
            rng = record["rng_key"]
            return cls(str(record["key"]), int(record["prompt_tokens"]), tuple(int(t) for t in record["emitted"]),
                       int(record["pending"]), None if rng is None else tuple(int(x) for x in rng),
                       float(record["created"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MlxkvError(f"malformed checkpoint record: {exc}") from None


def link_name(key: str, end: int) -> str:
    """The file stem (and header digest) of ``key``'s link that ends at token ``end``."""
    return f"{key}-{end}"


def parse_link_name(stem: str) -> tuple[str, int] | None:
    """(key, end) of a link's file stem; None for any other name."""
    key, dash, end = stem.rpartition("-")
    return (key, int(end)) if dash and key and end.isdigit() else None


def link_header(record: CheckpointRecord, start: int, tokens: list[int], trimmable: bool, identity,
                model_name: str) -> dict:
    """The header of the link covering ``tokens[start:]`` (``tokens``: the prompt and every emitted token)."""
    return {"fingerprint": identity.fingerprint, "kv_scheme": identity.kv_scheme, "namespace": identity.namespace,
            "digest": link_name(record.key, record.end), "parent": link_name(record.key, start) if start else "",
            "start": start, "tokens": list(tokens[start:]), "trimmable": trimmable, "snapshot": True,
            "created": record.created, "model": model_name, "checkpoint": record.as_header()}


def cut_layer(kind: str, meta: dict, named: list, start: int) -> tuple[str, dict, list]:
    """An encoded layer (store.layer_codec) as a link starting at ``start`` holds it: a span layer's
    tokens from ``start`` on (its offset: their count, as in a node file), any other layer whole."""
    if kind not in SPAN_KINDS or start == 0:
        return kind, meta, named
    return kind, {**meta, "offset": meta["offset"] - start}, [(name, a[..., start:, :]) for name, a in named]


@dataclass(frozen=True)
class LinkLayers:
    """One link's layers, read or still in memory: [(kind, meta, {name: array})], and the span it covers."""

    start: int
    end: int
    layers: list


def join_chain(links: list[LinkLayers]) -> list:
    """The caches of a whole chain (first link first): span layers joined along the token axis, the
    others as the newest link holds them. MlxkvError when the links do not fit together."""
    newest = links[-1]
    for before, after in zip(links, links[1:], strict=False):
        if before.end != after.start or len(before.layers) != len(after.layers):
            raise MlxkvError(f"link {after.start}-{after.end} does not continue link {before.start}-{before.end}")
    if links[0].start != 0:
        raise MlxkvError(f"the chain starts at token {links[0].start}")
    caches = []
    for i, (kind, meta, tensors) in enumerate(newest.layers):
        if kind in SPAN_KINDS:
            if any(link.layers[i][0] != kind for link in links):
                raise MlxkvError(f"layer {i} changes kind along the chain")
            tensors = {name: _join([link.layers[i][2][name] for link in links]) for name in tensors}
            if _tokens(tensors) != newest.end:
                raise MlxkvError(f"layer {i} holds {_tokens(tensors)} tokens, the chain {newest.end}")
            meta = {**meta, "offset": newest.end}
        caches.append(decode_layer(kind, meta, tensors))
    return caches


def _join(parts: list) -> mx.array:
    return mx.concatenate(parts, axis=-2) if len(parts) > 1 else mx.array(parts[0])


def _tokens(tensors: dict) -> int:
    return next(iter(tensors.values())).shape[-2] if tensors else 0
