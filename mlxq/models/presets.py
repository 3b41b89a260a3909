"""Model shapes the tiny-model factory can build: architectures x sizes.

Every attention head is 64 wide (128 for the 8B shape) so KV quantization
with group size 64 divides head_dim.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

ARCHS = ("llama", "qwen3", "gemma3_text", "qwen3_next")


@dataclass(frozen=True)
class Size:
    """One size row: the dims every architecture shares."""

    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # per-head width
    intermediate: int  # MLP width
    vocab: int  # vocabulary size (the tokenizer is padded to it)
    context: int  # max_position_embeddings
    dtype: str  # weight dtype on disk
    tie: bool  # tie_word_embeddings


SIZES: dict[str, Size] = {
    # Fast tests: a forward pass costs well under a millisecond on 2 CPU cores.
    "tiny": Size(128, 4, 2, 1, 64, 256, 512, 4096, "float32", True),
    # The embedded default of `mlxq serve`: builds in ~1 s, decodes quickly. Its 64k context holds
    # a real agent's first turn (opencode's is ~17k tokens); random RoPE weights do not care.
    "default": Size(256, 4, 4, 2, 64, 768, 1024, 65536, "float32", True),
    # CPU benchmarks: ~33M parameters.
    "small": Size(512, 8, 8, 4, 64, 1536, 8192, 8192, "float32", False),
    # Real shapes for the GPU (random weights, bf16).
    "llama3-1b": Size(2048, 16, 32, 8, 64, 8192, 128256, 131072, "bfloat16", True),
    "llama3-8b": Size(4096, 32, 32, 8, 128, 14336, 128256, 131072, "bfloat16", False),
    # ~141 GB: two GPUs' worth; served as --model random:llama3-70b (models/random_model.py), never written.
    "llama3-70b": Size(8192, 80, 64, 8, 128, 28672, 128256, 131072, "bfloat16", False),
}

# Sliding window of the tiny gemma: short prompts already cross it.
TINY_SLIDING_WINDOW = 16


def _common(size: Size) -> dict:
    return {
        "hidden_size": size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.head_dim,
        "intermediate_size": size.intermediate,
        "vocab_size": size.vocab,
        "max_position_embeddings": size.context,
        "tie_word_embeddings": size.tie,
        "rms_norm_eps": 1e-5,
        "torch_dtype": size.dtype,
    }


def _llama(size: Size) -> dict:
    cfg = {"model_type": "llama", "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False}
    if size.context > 8192:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return cfg


def _qwen3(size: Size) -> dict:
    return {"model_type": "qwen3", "rope_theta": 1000000.0}


def _gemma3_text(size: Size) -> dict:
    window = TINY_SLIDING_WINDOW if size.hidden <= 512 else 1024
    return {
        "model_type": "gemma3_text",
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": size.head_dim,
        "sliding_window": window,
        "sliding_window_pattern": 2,
        "rms_norm_eps": 1e-6,
    }


def _qwen3_next(size: Size) -> dict:
    return {
        "model_type": "qwen3_next",
        "rope_theta": 1000000.0,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2,
        "linear_num_value_heads": size.heads,
        "linear_num_key_heads": max(1, size.heads // 2),
        "linear_key_head_dim": size.head_dim,
        "linear_value_head_dim": size.head_dim,
        "linear_conv_kernel_dim": 4,
        # Dense MLP in every layer: the recurrent state is what we test, not MoE.
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "mlp_only_layers": [],
        "moe_intermediate_size": 0,
        "norm_topk_prob": True,
    }


_ARCH_CONFIG = {"llama": _llama, "qwen3": _qwen3, "gemma3_text": _gemma3_text, "qwen3_next": _qwen3_next}


def make_config(arch: str, preset: str) -> dict:
    """The config.json for ``arch`` at ``preset`` size (without token ids)."""
    if arch not in _ARCH_CONFIG:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if preset not in SIZES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(SIZES)}")
    size = SIZES[preset]
    config = _common(size)
    config.update(_ARCH_CONFIG[arch](size))
    return copy.deepcopy(config)
