"""Prefix reuse, one policy for every lane: where a request starts, where it snapshots, what it stores.

- **Start**: from the longest stored prefix the prompt cache (RAM, then SSD)
  can serve, at most all but the prompt's last token (``usable_prefix``).
- **Snapshot** (layers that cannot be cut back: rings, recurrent state):
  at the end of a shared system prompt (``system_snapshot``: the prefill
  stops a chunk exactly there, so other agents start from it) and at the
  prompt boundary, all but the last token (``boundary_snapshot``: where the
  next turn of the same conversation starts). Full attention snapshots the
  boundary too when the prompt is likely shared (a system prompt, or
  joiners waiting on it): agents arriving during its prefill start there.
- **Store at the end**: full-attention state, cut to every token fed
  (prompt, then generated), when the request ends (``finish_tokens``).

Both lanes ask these functions and do what they answer; the serial lane with
mlx-lm's loop, the batch lane with its joiners. That is what keeps the chunk
geometry, and so the tokens, of a batch row equal to the serial lane's.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxq.kv.capabilities import is_trimmable

# Snapshot a prompt boundary only when the prefix is worth a lookup.
MIN_SNAPSHOT_TOKENS = 32
COMPARE_BLOCK = 256  # tokens compared as one slice by common_prefix


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``.

    Blocks are compared as slices first (C speed: a burst of agents compares
    every pair of 2k-token prompts at admission), then the differing block
    token by token; sequences of different types never compare equal as
    slices, so they go token by token throughout."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n:
        end = min(i + COMPARE_BLOCK, n)
        if a[i:end] != b[i:end]:
            break
        i = end
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_prefix(stored: Sequence[int], trimmable: bool, prompt: Sequence[int]) -> int:
    """Prompt tokens an entry holding ``stored`` can serve: at most all but the prompt's last token
    (it is computed fresh, for the first logits). A ring or a recurrent state cannot be cut back, so an
    untrimmable entry serves only a prompt it is an exact prefix of (0 otherwise)."""
    n = common_prefix(stored, prompt, len(prompt) - 1)
    return n if trimmable or n == len(stored) else 0


def system_snapshot(prompt_len: int, snapshot_at: int | None, done: int, trimmable: bool) -> int | None:
    """Where to stop a prefill chunk and snapshot the state at the end of the system prompt, or None:
    only for caches that cannot be trimmed, ahead of what is done, before the prompt boundary."""
    if trimmable or snapshot_at is None or snapshot_at < MIN_SNAPSHOT_TOKENS:
        return None
    return snapshot_at if done < snapshot_at < prompt_len - 1 else None


def boundary_snapshot(prompt_len: int, trimmable: bool, shared: bool = False) -> int | None:
    """The token count to store once all but the last prompt token are in, or None.

    Untrimmable caches always do (their state exists only there); full-attention caches
    when the prompt is likely shared (``shared``: other joiners wait to take its prefix now,
    or it starts with a system prompt other agents send too): agents that arrive while it
    prefills then start from it, not from nothing. Others store when the request ends."""
    boundary = prompt_len - 1
    if boundary < MIN_SNAPSHOT_TOKENS or (trimmable and not shared):
        return None
    return boundary


def finish_tokens(fed_tokens: Sequence[int], caches: list) -> list[int] | None:
    """What to store when a request ends: the tokens its caches hold (the first ``offset`` of its
    prompt + generated tokens), for full-attention caches only (the others stored snapshots)."""
    return list(fed_tokens[: caches[0].offset]) if is_trimmable(caches) else None
