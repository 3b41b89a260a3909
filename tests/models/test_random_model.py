"""`--model random:PRESET`: weights drawn in memory, the same as the tiny factory's MLX draw on disk."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxq.models.loader import ModelNotFoundError, load_model
from mlxq.models.random_model import random_model_dir
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


def test_ranks_making_one_random_model_directory_at_once_all_get_it_whole(tmp_path, monkeypatch):
    """Every rank of a `--tensor-parallel` server writes the directory on a first start; whoever
    installs last, each gets the complete directory, the same bytes as one writer, no leftovers."""
    alone = random_model_dir("random:tiny")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    start = threading.Barrier(6)

    def make(_):
        start.wait()
        return random_model_dir("random:tiny")

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        made = set(pool.map(make, range(6)))
    assert len(made) == 1
    out = made.pop()
    assert out.parent == tmp_path / "mlxq-random" and sorted(p.name for p in out.parent.iterdir()) == [out.name]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in alone.iterdir()}
    assert load_model("random:tiny").name == "random-tiny-llama"


def test_a_directory_another_rank_moves_in_first_is_kept_and_completed(tmp_path, monkeypatch):
    """The narrow race: ``out`` is missing when checked and present when this rank moves its build in."""
    alone = random_model_dir("random:tiny")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "mlxq-random" / alone.name
    move = os.replace

    def another_rank_first(src, dst):
        if Path(dst) == out and not out.exists():
            shutil.copytree(alone, out)
        move(src, dst)

    monkeypatch.setattr(os, "replace", another_rank_first)
    assert random_model_dir("random:tiny") == out
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in alone.iterdir()}
