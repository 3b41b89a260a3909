"""Can a request ever run under --kv-budget? Pure Python: the HTTP side asks before submitting."""

from __future__ import annotations

from mlxq.kv.projection import KvFootprint


class AdmissionError(ValueError):
    """A request that can never run here (e.g. its KV alone exceeds --kv-budget)."""


def check_fits_alone(footprint: KvFootprint, budget: int, num_prompt: int, max_tokens: int) -> None:
    """Raise AdmissionError, with the largest max_tokens that would fit, when a row alone exceeds the budget."""
    need = footprint.row_bytes(num_prompt + max_tokens, num_prompt)
    if need <= budget:
        return
    fits = max_tokens_within(footprint, budget, num_prompt)
    hint = f"lower max_tokens to {fits}" if fits > 0 else "shorten the prompt"
    raise AdmissionError(
        f"this request needs {need / 1e6:.1f} MB of KV cache (prompt {num_prompt} + max_tokens "
        f"{max_tokens} tokens), more than the server's whole --kv-budget of {budget / 1e6:.1f} MB: {hint}"
    )


def max_tokens_within(footprint: KvFootprint, budget: int, num_prompt: int) -> int:
    """The largest max_tokens whose row alone fits the budget (0 if none): a binary search."""
    lo, hi = 0, 1 << 22
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if footprint.row_bytes(num_prompt + mid, num_prompt) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
