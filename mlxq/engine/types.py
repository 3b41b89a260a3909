"""The engine's boundary types: what the server submits and what it gets back.

Nothing here imports MLX; the HTTP side builds and reads these freely.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    """Why a generation ended (OpenAI's names where OpenAI has one)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away or the server is shutting down
    ERROR = "error"  # the engine raised while running this request


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token; field names and defaults follow mlx_lm.server."""

    temperature: float = 0.0  # 0 is greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept; 1.0 disables
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    min_p: float = 0.0  # drop tokens below min_p * p(top); 0 disables
    repetition_penalty: float = 0.0  # 0 or 1 disables
    repetition_context_size: int = 20  # tokens the repetition penalty looks back
    presence_penalty: float = 0.0  # 0 disables
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # 0 disables
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = None  # token id -> additive bias
    xtc_probability: float = 0.0  # "exclude top choices" sampling; 0 disables
    xtc_threshold: float = 0.1
    seed: int | None = None  # seeds MLX's generator before this request, like mlx_lm.server

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output: every token drawn must keep the text inside this grammar."""

    kind: str  # what the client asked for: "json_object", "json_schema" or "tool_call" (for logs and /stats)
    grammar: str  # an llguidance grammar (its JSON form), validated against the model's tokenizer


@dataclass
class Request:
    """One generation, tokenized and validated by the server."""

    request_id: str  # unique per server lifetime, also the OpenAI response id
    prompt_ids: list[int]  # the full prompt, template applied
    params: SamplingParams
    max_tokens: int  # completion token limit (>= 1)
    stop: tuple[str, ...] = ()  # stop strings; the matched text is not returned
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # also return this many alternatives per position
    ignore_eos: bool = False  # EOS is an ordinary token: generate exactly max_tokens (benchmarks)
    deterministic: bool = False  # run on the serial lane: output independent of other requests
    snapshot_at: int | None = None  # a prompt position worth its own prompt-cache entry (end of a system prompt)
    namespace: str = ""  # prompt-cache partition (an adapter's identity); "" is the base model
    adapter: str = ""  # the --adapter this request runs with (its model id); "" is the base model
    grammar: GrammarSpec | None = None  # structured output: tokens outside it are never drawn
    num_choices: int = 1  # the client's n: this request is one of n choices (n > 1 is not checkpointed)
    submitted_at: float = field(default_factory=time.monotonic)
    received_at: float | None = None  # when the server began reading it (time.monotonic): parse = submitted - this
    read_at: float | None = None  # when the server's event loop read its headers off the socket (time.monotonic)
    # Set from any thread; the engine checks it between steps and stops the row.
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at one position."""

    token_id: int
    token: str  # the token's string form (tokenizer vocabulary entry)
    logprob: float


@dataclass(frozen=True)
class Usage:
    """Token counts and timings of one finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a prompt cache, not recomputed
    queue_s: float  # submit -> engine picked it up
    ttft_s: float  # submit -> first token sampled
    decode_s: float  # first token -> last token
    inter_token_s: tuple[float, ...] = ()  # gaps between successive tokens, at the engine
    checkpoint_tokens: int = 0  # completion tokens restored from a generation checkpoint, not generated again
    ttft_phases_ms: dict[str, float] | None = None  # batch lane: admission -> token 0 in phases (engine/ttft_phases.py)
    parse_s: float | None = None  # received -> submitted: body read, parsed, rendered, tokenized (server requests)

    @property
    def prefill_s(self) -> float:
        """Engine pickup -> first token: the prompt's prefill (and its interleaving)."""
        return max(0.0, self.ttft_s - self.queue_s) if self.ttft_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request's output stream, engine -> server.

    The last event of every request has ``finish_reason`` set (and ``usage``);
    ``error`` is set only when finish_reason is ERROR.
    """

    request_id: str
    text: str = ""  # new text since the previous event (stop strings already cut)
    token_id: int | None = None  # the sampled token this event is about, if any
    logprob: float | None = None  # its logprob, when requested
    top_logprobs: tuple[TopLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the request, when one did


@dataclass(frozen=True)
class RequestDone:
    """Handed to engine observers (metrics, request log) exactly once per request."""

    request: Request
    lane: str  # "serial" or "continuous"
    finish_reason: FinishReason
    usage: Usage | None  # None when the request never reached the engine's lanes
    error: str | None = None
