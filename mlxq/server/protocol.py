"""Parse an OpenAI-style completion body into a validated ``GenerationSpec``.

Accepts every field mlx_lm.server reads (with its defaults), validates types
and ranges, and refuses what mlxq does not do yet (adapters, draft models;
for completions ``echo``, ``suffix``, ``best_of`` > 1) instead of ignoring it.
``response_format`` and a forced ``tool_choice`` become a grammar (structured.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mlxq.engine.types import GrammarSpec, SamplingParams
from mlxq.server.errors import APIError, invalid
from mlxq.server.prompts import system_prefix_length, tokenize_chat, tokenize_completion
from mlxq.server.request_defaults import PROTOCOL_DEFAULTS, RequestDefaults
from mlxq.server.structured import chat_grammar, response_format_grammar
from mlxq.server.template_kwargs import read_template_kwargs
from mlxq.server.validate import (
    read_bool,
    read_dict,
    read_int,
    read_number,
    read_stop,
    read_str,
)

DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's default
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: each choice is a request of its own in the batch


@dataclass(frozen=True)
class TokenLimits:
    """How a request's max_tokens meets the server's limits."""

    cap: int | None = None  # --max-tokens-limit: the most tokens one request may generate
    policy: Literal["clamp", "reject"] = "clamp"  # --max-tokens-policy: above the room left, clamp or 400


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, ready to become an ``engine.Request``."""

    kind: Literal["chat", "completion"]
    model: str  # as the client named it (echoed back)
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final usage chunk
    logprobs: bool
    top_logprobs: int
    ignore_eos: bool  # vLLM's extension: EOS does not end the request
    deterministic: bool  # mlxq's extension: run on the serial lane (bits independent of other requests)
    snapshot_at: int | None  # end of the shared system prompt: a prompt-cache snapshot point
    tools: list | None  # tool definitions given: parse tool calls out of the output
    n: int = 1  # choices: n requests on the same prompt (choice i samples with seed + i when seeded)
    grammar: GrammarSpec | None = None  # response_format / forced tool call: the output must match it


def parse_generation(body, kind: Literal["chat", "completion"], lm, limits: TokenLimits = TokenLimits(),
                     defaults: RequestDefaults = PROTOCOL_DEFAULTS) -> GenerationSpec:
    """Validate ``body`` against the loaded model ``lm`` (a models.LoadedModel); fields it leaves out
    take the server's ``defaults``."""
    tokenizer = lm.tokenizer
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _refuse_unsupported(body, kind)
    tools = _read_tools(body)
    if body.get("tool_choice") == "none":
        tools = None
    if kind == "chat":
        template_kwargs = {**defaults.template_args, **read_template_kwargs(body)}
        prompt_ids = tokenize_chat(tokenizer, body.get("messages"), tools or None, template_kwargs, lm.context_length)
        snapshot_at = system_prefix_length(tokenizer, body["messages"], tools or None, template_kwargs, prompt_ids)
    else:
        snapshot_at = None
        prompt_ids = tokenize_completion(tokenizer, body.get("prompt"), lm.context_length)
        if any(not 0 <= t < lm.vocab_size for t in prompt_ids):
            raise invalid(f"'prompt' token ids must be in 0-{lm.vocab_size - 1}", "prompt")
    max_tokens = _read_max_tokens(body, len(prompt_ids), lm.context_length, limits,
                                 defaults.get("max_tokens", DEFAULT_MAX_TOKENS))
    logprobs, top_logprobs = _read_logprobs(body, kind)
    stream = read_bool(body, "stream", False)
    stream_options = read_dict(body, "stream_options") or {}
    grammar = chat_grammar(body, tools, lm) if kind == "chat" else response_format_grammar(
        body.get("response_format"), lm)
    if grammar is not None and read_bool(body, "ignore_eos", False):
        raise invalid("'ignore_eos' cannot be combined with structured output (the grammar ends at EOS)",
                      "ignore_eos")
    return GenerationSpec(
        kind=kind,
        model=read_str(body, "model", "default_model"),
        prompt_ids=prompt_ids,
        params=_read_sampling(body, lm.vocab_size, defaults),
        max_tokens=max_tokens,
        stop=read_stop(body),
        stream=stream,
        include_usage=bool(stream and read_bool(stream_options, "include_usage", False)),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=read_bool(body, "ignore_eos", False),
        deterministic=read_bool(body, "deterministic", False),
        snapshot_at=snapshot_at,
        tools=tools or None,
        n=read_int(body, "n", 1, lo=1, hi=MAX_CHOICES),
        grammar=grammar,
    )


def _read_tools(body: dict) -> list | None:
    """Function tools as OpenAI defines them: a malformed one is a 400 naming it, not a template error."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise invalid("'tools' must be a list of objects", "tools")
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise invalid(f"tools[{i}].type must be 'function', got {tool.get('type')!r}", "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"tools[{i}].function must be an object with a non-empty 'name'", "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    return tools


def _refuse_unsupported(body: dict, kind: str) -> None:
    """Fields that would change the answer if they were ignored."""
    if kind == "completion":
        if read_bool(body, "echo", False):
            raise invalid("'echo' is not supported yet", "echo", "unsupported")
        if read_str(body, "suffix", ""):
            raise invalid("'suffix' (insertion) is not supported yet", "suffix", "unsupported")
        if read_int(body, "best_of", 1, lo=1) != 1:
            raise invalid("'best_of' other than 1 is not supported yet", "best_of", "unsupported")
    if body.get("adapters") is not None:
        raise invalid("'adapters' (an adapter path per request) is not supported: the server loads adapters "
                      "at start (--adapter NAME=PATH) and 'model' selects one", "adapters", "unsupported")
    if read_str(body, "draft_model", "default_model") != "default_model":
        raise invalid("'draft_model' is not supported yet", "draft_model", "unsupported")
    read_int(body, "num_draft_tokens", 0, lo=0)


def _read_max_tokens(body: dict, num_prompt: int, context_length: int | None, limits: TokenLimits,
                     default: int) -> int:
    requested = read_int(body, "max_completion_tokens", None, lo=1)
    if requested is None:
        requested = read_int(body, "max_tokens", None, lo=1)
    room = None if context_length is None else context_length - num_prompt
    if room is not None and room < 1:
        raise APIError(
            400,
            f"the prompt is {num_prompt} tokens, and the model's context is {context_length}: "
            "shorten the prompt",
            param="messages",
            code="context_length_exceeded",
        )
    if requested is None:
        default = default if limits.cap is None else min(default, limits.cap)
        return default if room is None else min(default, room)
    if limits.policy == "clamp":
        # Agents ask for their own model's maximum (Claude Code: 64000) whatever the server runs:
        # generate as much as fits, and say finish_reason "length" when that is what ended it.
        return min(x for x in (requested, room, limits.cap) if x is not None)
    if room is not None and requested > room:
        raise APIError(
            400,
            f"prompt ({num_prompt} tokens) + max_tokens ({requested}) exceeds the model's context "
            f"of {context_length} tokens: lower max_tokens to at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _read_logprobs(body: dict, kind: str) -> tuple[bool, int]:
    raw = body.get("logprobs")
    if kind == "completion" and isinstance(raw, int) and not isinstance(raw, bool):
        # Legacy completions: logprobs is the number of alternatives (0-5).
        top = read_int(body, "logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        return True, top
    wanted = read_bool(body, "logprobs", False)
    top = read_int(body, "top_logprobs", 0, lo=-1, hi=MAX_TOP_LOGPROBS)
    return wanted, max(top, 0) if wanted else 0


def _read_logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    raw = read_dict(body, "logit_bias")
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key in raw:
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise invalid(f"'logit_bias' token id {token} is outside the vocabulary (0-{vocab_size - 1})",
                          "logit_bias")
        bias[token] = read_number(raw, key, 0.0, lo=-100, hi=100)
    return bias


def _read_top_k(body: dict, vocab_size: int, default: int) -> int:
    top_k = read_int(body, "top_k", default, lo=0)
    return 0 if top_k >= vocab_size else top_k  # keeping every token is no filter (mlx-lm refuses k >= vocab)


def _read_sampling(body: dict, vocab_size: int, defaults: RequestDefaults) -> SamplingParams:
    return SamplingParams(
        temperature=read_number(body, "temperature", defaults.get("temperature", 0.0), lo=0, hi=100),
        top_p=read_number(body, "top_p", defaults.get("top_p", 1.0), lo=0, hi=1),
        top_k=_read_top_k(body, vocab_size, defaults.get("top_k", 0)),
        min_p=read_number(body, "min_p", defaults.get("min_p", 0.0), lo=0, hi=1),
        repetition_penalty=read_number(body, "repetition_penalty", 0.0, lo=0, hi=100),
        repetition_context_size=read_int(body, "repetition_context_size", 20, lo=0, hi=1 << 20),
        presence_penalty=read_number(body, "presence_penalty", 0.0, lo=-100, hi=100),
        presence_context_size=read_int(body, "presence_context_size", 20, lo=0, hi=1 << 20),
        frequency_penalty=read_number(body, "frequency_penalty", 0.0, lo=-100, hi=100),
        frequency_context_size=read_int(body, "frequency_context_size", 20, lo=0, hi=1 << 20),
        logit_bias=_read_logit_bias(body, vocab_size),
        xtc_probability=read_number(body, "xtc_probability", 0.0, lo=0, hi=1),
        xtc_threshold=read_number(body, "xtc_threshold", 0.1, lo=0, hi=1),
        seed=read_int(body, "seed", None, lo=0, hi=(1 << 63) - 1),
    )
