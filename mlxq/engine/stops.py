"""Stop strings over streamed text: cut at the first match, never leak a partial one.

Text that could still turn out to be the start of a stop string is held back
until the next piece decides it, so a client never sees "<|st" and then a cut.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # text safe to emit now
    stopped: bool  # a stop string matched; text ends just before it
    matched: str | None = None  # which stop string (Anthropic's stop_sequence reports it)


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, piece: str) -> StopResult:
        if not self._stops:
            return StopResult(piece, False)
        text = self._held + piece
        found = [(at, stop) for stop in self._stops if (at := text.find(stop)) >= 0]
        if found:
            first, matched = min(found)
            self._held = ""
            return StopResult(text[:first], True, matched)
        keep = self._longest_suffix_that_starts_a_stop(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """At the end of the stream, what was held back is ordinary text."""
        held, self._held = self._held, ""
        return held

    def _longest_suffix_that_starts_a_stop(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
