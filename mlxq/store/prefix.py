"""Which stored prefix a prompt can start from: shared by the RAM tier, the SSD tier and the batch lane."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_prefix(stored: Sequence[int], trimmable: bool, prompt: Sequence[int]) -> int:
    """Prompt tokens an entry holding ``stored`` can serve: at most all but the prompt's last token
    (it is computed fresh, for the first logits). A ring or a recurrent state cannot be cut back, so an
    untrimmable entry serves only a prompt it is an exact prefix of (0 otherwise)."""
    n = common_prefix(stored, prompt, len(prompt) - 1)
    return n if trimmable or n == len(stored) else 0
