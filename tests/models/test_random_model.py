"""`--model random:PRESET`: weights drawn in memory, the same as the tiny factory's MLX draw on disk."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxq.models.loader import ModelNotFoundError, load_model
from mlxq.models.tiny import build_tiny_model


def test_random_weights_equal_the_factory_s_fast_init_files(tmp_path):
    drawn = load_model("random:default")
    written = load_model(str(build_tiny_model("llama", tmp_path / "m", preset="default", fast_init=True)))
    mine, theirs = dict(tree_flatten(drawn.model.parameters())), dict(tree_flatten(written.model.parameters()))
    assert mine.keys() == theirs.keys()
    assert all(mx.array_equal(mine[name], theirs[name]).item() for name in mine)
    assert drawn.tokenizer.encode("hello world") == written.tokenizer.encode("hello world")
    assert drawn.name == "random-default-llama" and not list(drawn.path.glob("*.safetensors"))


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ModelNotFoundError, match="unknown preset 'llama3-405b'; choose one of .*llama3-70b"):
        load_model("random:llama3-405b")
