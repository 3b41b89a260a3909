"""Which generation a checkpoint belongs to, and which generations are checkpointed at all (plain data).

A checkpoint may only resume the request that wrote it: the key covers the
rendered prompt ids and every field that changes the output (each sampling
parameter, the seed, max_tokens, stop strings, EOS handling, the KV
representation, the prompt-cache namespace and the adapter). Two requests
with equal keys produce the same tokens, so one may resume the other's.

Not checkpointed (``not_checkpointed`` says why): a replay re-emits tokens
through the ordinary output path and cannot rebuild what is not a function
of the tokens alone: logprobs, a grammar matcher's state, one of n > 1
choices (their streams are merged), and unseeded sampling (MLX's global key
cannot be replayed to where it stood).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from mlxq.engine.types import Request, SamplingParams


@dataclass(frozen=True)
class CheckpointKey:
    """Everything a checkpoint's output depends on besides the model (the store's directory holds that)."""

    prompt_ids: tuple[int, ...]  # the rendered prompt, template applied
    sampling: tuple[tuple[str, object], ...]  # every SamplingParams field, logit bias as sorted pairs
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    kv_scheme: str  # the KV representation's key (kv.scheme): "native" or a --kv-quant scheme
    namespace: str  # the prompt-cache partition
    adapter: str = ""  # the --adapter a request runs with (its content identity is the namespace); "" base

    @property
    def digest(self) -> str:
        """32 hex digits naming the checkpoint file (blake2b-128 of the key's canonical JSON)."""
        body = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(body, digest_size=16).hexdigest()


def _sampling_fields(params: SamplingParams) -> tuple[tuple[str, object], ...]:
    out = []
    for f in fields(params):
        value = getattr(params, f.name)
        if f.name == "logit_bias" and value is not None:
            value = tuple(sorted((int(k), float(v)) for k, v in value.items()))
        out.append((f.name, value))
    return tuple(out)


def checkpoint_key(request: Request, kv_scheme: str) -> CheckpointKey:
    return CheckpointKey(tuple(request.prompt_ids), _sampling_fields(request.params), request.max_tokens,
                         tuple(request.stop), request.ignore_eos, kv_scheme, request.namespace, request.adapter)


def not_checkpointed(request: Request) -> str | None:
    """Why ``request`` is never checkpointed, or None when it is."""
    if request.logprobs or request.top_logprobs:
        return "logprobs requested"
    if request.num_choices > 1:
        return "one of n > 1 choices"
    if request.grammar is not None:
        return "grammar-constrained"
    if not request.params.is_greedy and request.params.seed is None:
        return "sampled without a seed"
    return None


def is_due(num_generated: int, interval: int, last: int) -> bool:
    """Publish after token ``num_generated`` when ``interval`` tokens passed since the last checkpoint (``last``)."""
    return interval > 0 and num_generated - last >= interval
