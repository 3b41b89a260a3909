"""`mlxq serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from mlxq.cli.config_file import CONFIG_ENV, apply_config_file

EXAMPLES = """Examples:

  mlxq serve                                     # the embedded tiny model
  mlxq serve --model mlx-community/Qwen3-4B-4bit --ssd-cache ~/.mlxq-kv
  mlxq serve --config mlxq.toml --port 9000      # flags override the file
"""


def _read_config(ctx: typer.Context, path: Path | None) -> Path | None:
    return apply_config_file(ctx, path, serve)


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def serve(
    config_file: Annotated[Path | None, typer.Option(
        "--config", envvar=CONFIG_ENV, is_eager=True, callback=_read_config, dir_okay=False,
        help="TOML file of settings: keys are the flag names without -- (kv-budget = \"8GB\"); flags given "
             "here override it.")] = None,
    model: Annotated[str | None, typer.Option(help="Model directory or a repo id in the local HF cache. "
                                                   "Default: the embedded tiny model (no download).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8080,
    served_model_name: Annotated[str | None, typer.Option(help="Model id reported by /v1/models.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="MLXQ_API_KEY",
                                                   help="Require 'Authorization: Bearer KEY' or 'x-api-key: "
                                                        "KEY' on every endpoint but /health, /ready and "
                                                        "/dashboard.")] = None,
    allowed_origins: Annotated[str, typer.Option(help="Browser origins allowed besides loopback ones "
                                                      "(http(s)://localhost|127.0.0.1|[::1]), comma-separated; "
                                                      "'*' allows any web page.")] = "",
    allowed_hosts: Annotated[str, typer.Option(help="Host header names allowed besides localhost, 127.0.0.1 and "
                                                    "::1 on a loopback bind, comma-separated; '*' turns the "
                                                    "check off.")] = "",
    prefill_step_size: Annotated[int, typer.Option(help="Prompt tokens per prefill pass.")] = 2048,
    batch: Annotated[int, typer.Option("--batch", "--decode-concurrency",
                                       help="Rows decoding together (continuous batching); "
                                            "1 = the strict serial lane.")] = 8,
    prompt_concurrency: Annotated[int, typer.Option(
        help="Batch joiners prefilling long prompts at once (one with at most 128 uncached tokens "
             "takes no slot).")] = 4,
    burst_window_ms: Annotated[str, typer.Option(
        help="How long a burst's short tails wait for the rest of the burst before their prefill, in "
             "ms (one forward for the wave); auto: 150 on a GPU, 0 on the CPU; 0: never wait. Off "
             "across ranks.")] = "auto",
    kv_budget: Annotated[str, typer.Option(help="Cap on projected KV bytes of the batch, e.g. 8GB; over it "
                                                  "requests queue. auto: 70% of the memory the weights and the "
                                                  "prompt cache leave; off: no cap.")] = "auto",
    prompt_cache: Annotated[str, typer.Option(help="RAM prompt cache size, e.g. 8GB; 0 disables it; auto: a "
                                                    "quarter of the memory the weights leave, at most 8GB.")]
    = "auto",
    memory_limit: Annotated[str, typer.Option(help="Memory MLX may use (its allocator's limit; the budgets and "
                                                    "its buffer cache are sized within it), e.g. 120GB. auto: 90% "
                                                    "of the device, at most what is free at start; off: MLX's "
                                                    "own limits.")] = "auto",
    kv_quant: Annotated[str, typer.Option(help="KV cache representation: off, 8, 4 (also 2, 3, 5, 6) bits, "
                                               "or config (per-layer bits from kv_config.json beside the "
                                               "model).")] = "off",
    kv_group_size: Annotated[int, typer.Option(help="Quantization group along head_dim: 32, 64 or 128.")] = 64,
    warmup: Annotated[str, typer.Option(help="Run every generation path once on synthetic prompts before "
                                             "reporting ready (GPU kernels compile on first use): on, off, "
                                             "auto (on for GPU backends).")] = "auto",
    shared_prefix_attention: Annotated[str | None, typer.Option(
        help="Batch rows on one prompt-cache prefix read it once per decode step: auto (the default: where "
             "measured faster, CUDA from 128k rows x prefix tokens after its kernels' start-up check, never on "
             "the CPU or Metal; off with several ranks, where it was not measured), on (any two rows on 32+ "
             "tokens), off.")] = None,
    ssd_cache: Annotated[str | None, typer.Option(help="Directory of the SSD cold tier (.mlxkv files); "
                                                       "prompt-cache entries survive restarts.")] = None,
    ssd_cache_max: Annotated[str | None, typer.Option(help="Byte cap of the SSD tier, e.g. 100GB "
                                                           "(default: unlimited).")] = None,
    ssd_cache_verify: Annotated[bool, typer.Option(help="Check every tensor checksum of every file at "
                                                        "start-up (restores always check).")] = False,
    ssd_demote_idle: Annotated[float, typer.Option(help="Release RAM entries idle this many seconds once "
                                                        "they are on disk; 0 never.")] = 300.0,
    checkpoint_interval: Annotated[int | None, typer.Option(help="With --ssd-cache: every this many tokens a "
                                                                 "running generation is checkpointed, and an "
                                                                 "identical request after a restart resumes it "
                                                                 "(default 256; 0 off).")] = None,
    stall_timeout: Annotated[float, typer.Option(help="Seconds without engine progress before /health "
                                                      "reports 503.")] = 120.0,
    shutdown_timeout: Annotated[float, typer.Option(help="On SIGINT/SIGTERM, seconds in-flight requests may "
                                                         "take to finish before they are cut.")] = 30.0,
    log_level: Annotated[LogLevel, typer.Option(help="How much to log.", case_sensitive=False)] = "info",
    log_format: Annotated[str, typer.Option(help="Request log lines: plain or json.")] = "plain",
    log_prompts: Annotated[bool, typer.Option(help="Include prompt text in request log lines.")] = False,
    max_request_bytes: Annotated[str, typer.Option(help="Refuse larger request bodies (413) before "
                                                        "parsing, e.g. 16MiB.")] = "16MiB",
    max_connections: Annotated[int, typer.Option(help="Open connections at once; more get 503 (lowered to fit "
                                                     "the open-file limit).")] = 4096,
    request_read_timeout: Annotated[float, typer.Option(help="Seconds a client has to send a whole request "
                                                             "(headers and body) before it is disconnected.")]
    = 60.0,
    max_tokens_limit: Annotated[int | None, typer.Option(help="Server-wide cap on max_tokens.")] = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(help="Per-request cap on prompt tokens.")] = None,
    max_tokens_policy: Annotated[str, typer.Option(help="max_tokens above the room left in the context (or "
                                                        "--max-tokens-limit): clamp or reject (400).")] = "clamp",
    temp: Annotated[float | None, typer.Option(help="Sampling temperature for requests that set none "
                                                    "(default: 0 for chat/completions, 1 for Responses and "
                                                    "Messages, as those APIs define).")] = None,
    top_p: Annotated[float | None, typer.Option(help="top_p for requests that set none (default 1).")] = None,
    top_k: Annotated[int | None, typer.Option(help="top_k for requests that set none (default 0: off).")] = None,
    min_p: Annotated[float | None, typer.Option(help="min_p for requests that set none (default 0: off).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="max_tokens for requests that set none (default: 512 for "
                                                        "chat/completions, the context's room for Responses).")]
    = None,
    chat_template: Annotated[str | None, typer.Option(help="A Jinja chat template, or a file holding one, "
                                                           "used instead of the model's.")] = None,
    chat_template_args: Annotated[str, typer.Option(help="JSON object of template variables for every chat "
                                                         "request, e.g. '{\"enable_thinking\": false}'; a "
                                                         "request's chat_template_kwargs win.")] = "{}",
    adapter: Annotated[list[str] | None, typer.Option(help="NAME=PATH: serve an mlx-lm LoRA/DoRA adapter "
                                                           "directory as model NAME (repeatable); requests "
                                                           "select it by 'model', rows of different adapters "
                                                           "decode in one batch.")] = None,
    tensor_parallel: Annotated[int, typer.Option(help="Shard the model over N ranks (mlx-lm's shard()): mlxq "
                                                      "starts N local processes (ring on the CPU, NCCL with one "
                                                      "GPU each on CUDA); under mlx.launch, pass the world size. "
                                                      "docs/distributed.md.")] = 1,
    pipeline_parallel: Annotated[int, typer.Option(help="Split the model's layers over N ranks (mlx-lm's "
                                                        "pipeline(), for models without shard()); started like "
                                                        "--tensor-parallel; the prompt cache is off with it.")]
    = 1,
    distributed_backend: Annotated[str, typer.Option(help="mx.distributed backend of the ranks: auto (nccl on "
                                                          "CUDA, ring on the CPU; any under mlx.launch), ring, "
                                                          "nccl, jaccl, mpi.")] = "auto",
) -> None:
    """Serve a model over OpenAI- and Anthropic-compatible HTTP APIs."""
    from mlxq.cli.units import flag_bytes
    from mlxq.distributed.launch import run_local_ranks
    from mlxq.distributed.world import launched_as_rank
    from mlxq.models.loader import ModelNotFoundError
    from mlxq.server.config import ServerConfig
    from mlxq.server.run import bind_listener
    from mlxq.server.run import serve as run_server

    try:
        if checkpoint_interval is None and tensor_parallel * pipeline_parallel > 1:
            checkpoint_interval = 0  # no generation checkpoints across ranks (docs/distributed.md)
        if shared_prefix_attention is None:  # each rank would check its kernels and decide its groups alone
            shared_prefix_attention = "off" if tensor_parallel * pipeline_parallel > 1 else "auto"
        ssd = _ssd_config(ssd_cache, ssd_cache_max, ssd_cache_verify, ssd_demote_idle, checkpoint_interval)
        config = ServerConfig(
            model=model, served_model_name=served_model_name, host=host, port=port, api_key=api_key,
            allowed_origins=_csv(allowed_origins), allowed_hosts=_csv(allowed_hosts),
            prefill_step_size=prefill_step_size, stall_timeout_s=stall_timeout, log_level=LogLevel(log_level).value,
            shutdown_timeout_s=shutdown_timeout,
            batch=batch, prompt_concurrency=prompt_concurrency, burst_window_ms=_burst_window(burst_window_ms),
            log_format=log_format, log_prompts=log_prompts,
            max_request_bytes=flag_bytes("--max-request-bytes", max_request_bytes), max_tokens_limit=max_tokens_limit,
            max_prompt_tokens=max_prompt_tokens, max_connections=max_connections,
            request_read_timeout_s=request_read_timeout, max_tokens_policy=max_tokens_policy.strip().lower(),
            kv_budget_bytes=None if kv_budget.strip().lower() in ("auto", "off", "none")
            else flag_bytes("--kv-budget", kv_budget),
            kv_budget_auto=kv_budget.strip().lower() == "auto",
            prompt_cache_bytes=_prompt_cache_bytes(prompt_cache),
            memory_limit_bytes=None if memory_limit.strip().lower() in ("auto", "off")
            else flag_bytes("--memory-limit", memory_limit),
            memory_limit_auto=memory_limit.strip().lower() == "auto",
            ssd=ssd, kv_quant=kv_quant.strip().lower(), kv_group_size=kv_group_size,
            warmup=warmup.strip().lower(), shared_prefix_attention=shared_prefix_attention.strip().lower(),
            temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
            max_tokens=max_tokens, chat_template=_chat_template(chat_template),
            chat_template_args=_json_object("--chat-template-args", chat_template_args),
            adapters=_adapters(adapter or [], served_model_name),
            tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
            distributed_backend=distributed_backend.strip().lower(),
        )
        if config.world_size > 1 and not launched_as_rank():
            bind_listener(config.host, config.port).close()  # a taken port fails now, before N ranks load
            raise typer.Exit(run_local_ranks(sys.argv[1:], config.world_size, config.distributed_backend))
        run_server(config)
    except (ValueError, ModelNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _ssd_config(directory: str | None, max_bytes: str | None, verify: bool, demote_idle: float,
                checkpoint_interval: int | None = None):
    """The SSD tier's settings; sub-flags without --ssd-cache are reported and ignored."""
    import os

    from mlxq.cli.units import flag_bytes, parse_bytes
    from mlxq.store.ssd_config import SsdConfig

    extra = {}
    if directory is None:
        if max_bytes is not None or verify or checkpoint_interval:
            typer.echo("warning: --ssd-cache-max / --ssd-cache-verify / --checkpoint-interval do nothing without "
                       "--ssd-cache DIR", err=True)
        return None
    if checkpoint_interval is not None:
        extra["checkpoint_interval"] = checkpoint_interval
    if "MLXQ_SSD_SPILL_QUEUE" in os.environ:
        extra["spill_queue_bytes"] = parse_bytes(os.environ["MLXQ_SSD_SPILL_QUEUE"])
    return SsdConfig(directory, flag_bytes("--ssd-cache-max", max_bytes) if max_bytes else None, verify, demote_idle,
                     write_behind=os.environ.get("MLXQ_SSD_WRITE_BEHIND", "1") != "0", **extra)


def _adapters(flags: list[str], model_name: str | None) -> tuple:
    """--adapter NAME=PATH flags, their names and each directory checked now (files, config), before
    anything loads (``model_name``: --served-model-name, when given)."""
    from mlxq.models.adapters import check_adapter_dir, check_model_ids, parse_adapter_flag

    specs = [parse_adapter_flag(flag) for flag in flags]
    check_model_ids([spec.name for spec in specs], model_name or "")
    for spec in specs:
        check_adapter_dir(spec)
    return tuple(specs)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _prompt_cache_bytes(text: str) -> int | None:
    from mlxq.cli.units import flag_bytes

    text = text.strip().lower()
    if text == "auto":
        return None
    return 0 if text in ("0", "0gb", "0b") else flag_bytes("--prompt-cache", text)


def _chat_template(value: str | None) -> str | None:
    """Jinja text as given, or read from the file it names; a path that is not there is an error,
    not a template that renders its own file name."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template (no {{{{ or {{%)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: cannot read {path}: {exc}") from None


def _json_object(flag: str, text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return value


def _burst_window(value: str) -> float | None:
    """--burst-window-ms: None for auto, else the milliseconds (ServerConfig checks the range)."""
    if value.strip().lower() == "auto":
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"--burst-window-ms must be auto or a number of milliseconds; got {value!r}") from None
