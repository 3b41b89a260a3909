"""What the server fills in when a request leaves a field out (`mlxq serve --temp/--top-p/...`).

mlx_lm.server's flags of the same names set these for every request; here they apply to every
protocol (chat, completions, Responses, Messages). ``None`` keeps the protocol's own default:
temperature 0 for chat/completions (mlx_lm.server's), 1 for Responses and Messages (OpenAI's and
Anthropic's), and max_tokens 512 for chat/completions, the room left in the context for Responses
(Messages requires max_tokens). A value the request sets always wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestDefaults:
    temperature: float | None = None  # --temp
    top_p: float | None = None  # --top-p
    top_k: int | None = None  # --top-k (0: no top-k filter)
    min_p: float | None = None  # --min-p
    max_tokens: int | None = None  # --max-tokens
    template_args: dict = field(default_factory=dict)  # --chat-template-args; a request's chat_template_kwargs win

    def get(self, name: str, protocol_default):
        """The server's default for ``name``, else the protocol's."""
        value = getattr(self, name)
        return protocol_default if value is None else value


PROTOCOL_DEFAULTS = RequestDefaults()  # no server-wide defaults: every protocol's own
