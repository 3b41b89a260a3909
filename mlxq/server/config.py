"""The server's frozen configuration, validated once; the CLI builds it from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxq.server.protocol import TokenLimits
from mlxq.server.request_defaults import RequestDefaults
from mlxq.server.template_kwargs import check_server_template_args
from mlxq.store.ssd_config import SsdConfig


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # local dir or cached HF repo id; None = the embedded default
    served_model_name: str | None = None  # id in /v1/models; defaults to the model's own name
    host: str = "127.0.0.1"  # loopback by default, like mlx_lm.server
    port: int = 8080
    api_key: str | None = None  # when set, every endpoint but /health needs "Bearer <key>"
    allowed_origins: tuple[str, ...] = ()  # browser origins beyond loopback ones (server/guard.py); "*": any
    allowed_hosts: tuple[str, ...] = ()  # Host names beyond loopback ones on a loopback bind; "*": any
    prefill_step_size: int = 2048  # prompt tokens per prefill pass
    batch: int = 8  # rows decoding together; 1 = the strict serial lane
    prompt_concurrency: int = 4  # batch joiners prefilling at once
    burst_window_ms: float | None = None  # a burst's tails wait this long for the rest; None: auto (GPU 150, CPU 0)
    kv_budget_bytes: int | None = None  # batch admission cap on projected KV bytes
    kv_budget_auto: bool = True  # no explicit budget: derive one from the device's memory (--kv-budget off: none)
    prompt_cache_bytes: int | None = None  # RAM prompt cache cap; 0 disables it; None: auto
    memory_limit_bytes: int | None = None  # MLX's memory limit; None: auto (90% of the device, within free)
    memory_limit_auto: bool = True  # --memory-limit off: leave MLX's own limits alone
    ssd: SsdConfig | None = None  # --ssd-cache DIR and its sub-flags
    kv_quant: str = "off"  # off, 2/3/4/5/6/8 bits, or config (kv_config.json beside the model)
    kv_group_size: int = 64
    warmup: str = "auto"  # run every generation path once before ready: on, off, auto (GPU backends)
    shared_prefix_attention: str = "auto"  # batch rows on one leased prefix read it once: auto, on, off
    stall_timeout_s: float = 120.0  # /health turns 503 when work is pending and no step ran this long
    shutdown_timeout_s: float = 30.0  # on SIGINT/SIGTERM: how long in-flight requests may take to finish
    log_level: str = "info"
    log_format: str = "plain"  # request log lines: plain or json
    log_prompts: bool = False  # include prompt text in request log lines (user data: off by default)
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413 before parsing
    max_connections: int = 4096  # open connections at once (more get 503); lowered to fit the open-file limit
    request_read_timeout_s: float = 60.0  # a client must send a whole request (headers and body) within this
    max_tokens_limit: int | None = None  # server-wide cap on max_tokens (None: the model's context)
    max_tokens_policy: str = "clamp"  # max_tokens above the room left (or the cap): clamp to it, or reject (400)
    max_prompt_tokens: int | None = None  # per-request prompt length cap (None: the model's context)
    temp: float | None = None  # request defaults (server/request_defaults.py); None: the protocol's own
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    chat_template: str | None = None  # Jinja text replacing the model's chat template (--chat-template)
    chat_template_args: dict = field(default_factory=dict)  # template variables every chat request gets
    adapters: tuple = ()  # --adapter NAME=PATH, models.adapters.AdapterSpec each, directories already checked
    tensor_parallel: int = 1  # ranks sharing the model (mlxq/distributed/); > 1: this process is one of them
    pipeline_parallel: int = 1  # ranks each running some of the layers (models without shard())
    distributed_backend: str = "auto"  # mx.distributed backend of those ranks (world.BACKENDS)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0-65535; got {self.port}")
        if self.prefill_step_size < 1:
            raise ValueError(f"--prefill-step-size must be >= 1; got {self.prefill_step_size}")
        if self.batch < 1 or self.prompt_concurrency < 1:
            raise ValueError(f"--batch and --prompt-concurrency must be >= 1; got {self.batch} and "
                             f"{self.prompt_concurrency}")
        if self.burst_window_ms is not None and not 0 <= self.burst_window_ms <= 10_000:
            raise ValueError(f"--burst-window-ms must be auto or 0-10000; got {self.burst_window_ms:g}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ValueError("--kv-budget must be > 0")
        if self.ssd is not None and self.prompt_cache_bytes == 0:
            raise ValueError("--ssd-cache needs the RAM prompt cache (--prompt-cache > 0): restores land there")
        if self.kv_quant not in ("off", "config") and self.kv_quant not in ("2", "3", "4", "5", "6", "8"):
            raise ValueError(f"--kv-quant must be off, 2, 3, 4, 5, 6, 8 or config; got {self.kv_quant!r}")
        if self.kv_group_size not in (32, 64, 128):
            raise ValueError(f"--kv-group-size must be 32, 64 or 128; got {self.kv_group_size}")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"--warmup must be auto, on or off; got {self.warmup!r}")
        if self.shared_prefix_attention not in ("auto", "on", "off"):
            raise ValueError(f"--shared-prefix-attention must be auto, on or off; got {self.shared_prefix_attention!r}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"--stall-timeout must be > 0; got {self.stall_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0; got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.max_tokens_policy not in ("clamp", "reject"):
            raise ValueError(f"--max-tokens-policy must be clamp or reject; got {self.max_tokens_policy!r}")
        if self.log_format not in ("plain", "json"):
            raise ValueError(f"--log-format must be plain or json; got {self.log_format!r}")
        if self.max_connections < 1 or self.request_read_timeout_s <= 0:
            raise ValueError("--max-connections must be >= 1 and --request-read-timeout > 0")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be >= 1024")
        self._check_request_defaults()
        self._check_distributed()
        for name in ("max_tokens_limit", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {value}")

    def _check_distributed(self) -> None:
        from mlxq.distributed.world import BACKENDS

        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError(f"--tensor-parallel and --pipeline-parallel must be >= 1; got {self.tensor_parallel} "
                             f"and {self.pipeline_parallel}")
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError("--tensor-parallel and --pipeline-parallel together are not available yet: pick one")
        if self.distributed_backend not in BACKENDS:
            raise ValueError(f"--distributed-backend must be one of {', '.join(BACKENDS)}; "
                             f"got {self.distributed_backend!r}")
        if self.world_size > 1 and self.ssd is not None and self.ssd.checkpoint_interval:
            raise ValueError(f"generation checkpoints are not available with --{self.parallel_mode}-parallel: "
                             "pass --checkpoint-interval 0 (its default there); the SSD prompt tier works")
        if self.pipeline_parallel > 1 and self.kv_quant == "config":
            raise ValueError("--kv-quant config is not available with --pipeline-parallel (its bits are by "
                             "layer number, and each rank numbers only its own layers)")

    @property
    def world_size(self) -> int:
        """Processes serving the model together (1: this one alone)."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def parallel_mode(self) -> str:
        return "pipeline" if self.pipeline_parallel > 1 else "tensor"

    def _check_request_defaults(self) -> None:
        for flag, value, lo, hi in (("--temp", self.temp, 0, 100), ("--top-p", self.top_p, 0, 1),
                                    ("--min-p", self.min_p, 0, 1), ("--top-k", self.top_k, 0, None),
                                    ("--max-tokens", self.max_tokens, 1, None)):
            if value is not None and not (lo <= value and (hi is None or value <= hi)):
                raise ValueError(f"{flag} must be {lo}-{hi}; got {value}" if hi is not None
                                 else f"{flag} must be >= {lo}; got {value}")
        check_server_template_args(self.chat_template_args)
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("--chat-template must not be empty")

    @property
    def request_defaults(self) -> RequestDefaults:
        return RequestDefaults(self.temp, self.top_p, self.top_k, self.min_p, self.max_tokens,
                               dict(self.chat_template_args))

    @property
    def token_limits(self) -> TokenLimits:
        return TokenLimits(self.max_tokens_limit, self.max_tokens_policy)

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")
