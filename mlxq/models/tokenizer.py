"""Train a small byte-level BPE tokenizer offline, the same bytes every run.

The tiny models need a real Hugging Face tokenizer (mlx-lm loads it through
transformers, picks its streaming detokenizer from ``tokenizer.json`` and its
tool parser from the chat template), but nothing can be downloaded. So we
train one from ``corpus.txt`` with the ``tokenizers`` library. Byte-level BPE
covers every input byte, so any prompt encodes.

A model's vocabulary may be larger than what the corpus supports (real shapes
such as Llama-3's 128256); the remainder is filled with plain added tokens
``<|f123|>`` so every id the model can sample also decodes.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS_TOKEN, "<tool_call>", "</tool_call>")

# ChatML with tools. The literal "<tool_call>" and "tool_call.name" make
# mlx-lm pick its json_tools parser (tokenizer_utils._infer_tool_parser).
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools. To call one, answer "
    '<tool_call>{"name": <tool_call.name>, "arguments": {...}}</tool_call>\n'
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- elif message.content %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus_lines() -> list[str]:
    text = resources.files("mlxq.models").joinpath("corpus.txt").read_text(encoding="utf-8")
    return text.splitlines()


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 4096),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    size = tokenizer.get_vocab_size()
    if size > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the trained size {size}")
    if size < vocab_size:
        from tokenizers import AddedToken

        fillers = [AddedToken(f"<|f{i}|>", special=False) for i in range(vocab_size - size)]
        tokenizer.add_tokens(fillers)
    return tokenizer


def write_tokenizer_files(out: Path, vocab_size: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json; return the special-token ids."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ids
