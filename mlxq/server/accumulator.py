"""One generation's output, protocol-neutral: text, tool calls, logprobs, finish, usage.

Every protocol's renderer (OpenAI chat and text, OpenAI Responses, Anthropic
Messages) reads the same accumulator: the engine's events are folded in once,
and a renderer only decides what the client's wire format looks like.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxq.engine.types import FinishReason, TokenEvent, TopLogprob, Usage
from mlxq.server.tools import ToolCall, make_splitter

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(frozen=True)
class LogprobEntry:
    """The sampled token at one position, with its alternatives."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...]
    offset: int  # characters of text before this token


@dataclass(frozen=True)
class Step:
    """What one engine event added."""

    text: str  # content to show now (tool-call markup held back or removed)
    calls: list[ToolCall]  # tool calls completed by this event
    logprob: LogprobEntry | None
    finished: bool


@dataclass
class Accumulator:
    """Folds a request's TokenEvents in; ``tools`` set means tool calls are parsed out of the text."""

    tokenizer: TokenizerWrapper
    tools: list | None = None
    want_logprobs: bool = False
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_sequence: str | None = None
    usage: Usage | None = None

    def __post_init__(self):
        self._splitter = make_splitter(self.tokenizer, self.tools)

    def add(self, event: TokenEvent) -> Step:
        text, calls = event.text, []
        if self._splitter is not None:
            text, calls = self._splitter.feed(text)
            if event.finish_reason is not None:
                text += self._splitter.flush()
        entry = self._logprob_entry(event, len(self.text))
        self.text += text
        self.calls.extend(calls)
        if event.finish_reason is not None:
            self.finish = event.finish_reason
            self.stop_sequence = event.stop_sequence
            self.usage = event.usage
        return Step(text, calls, entry, event.finish_reason is not None)

    @property
    def called_tools(self) -> bool:
        """The model ended its turn on tool calls (rather than running out of tokens)."""
        return bool(self.calls) and self.finish is FinishReason.STOP

    @property
    def is_complete(self) -> bool:
        """Ended by the model or max_tokens (not cancelled, e.g. by a shutdown): a reply worth sending."""
        return self.finish in (FinishReason.STOP, FinishReason.LENGTH)

    def _logprob_entry(self, event: TokenEvent, offset: int) -> LogprobEntry | None:
        if not self.want_logprobs or event.token_id is None or event.logprob is None:
            return None
        entry = LogprobEntry(self.tokenizer.decode([event.token_id]), event.logprob, event.top_logprobs, offset)
        self.logprobs.append(entry)
        return entry
