"""`mlxq cache ls|verify|prune` on real .mlxkv files written by the store."""

from __future__ import annotations

import json
import os
import time

from typer.testing import CliRunner

from mlxq.cli.main import app
from mlxq.store.mlxkv import Identity
from mlxq.store.ssd_store import SsdStore
from tests.store.test_cold_tier import whole
from tests.store.test_prompt_cache import cache_with

runner = CliRunner()


def populate(root, fingerprint: str, prompts: list[list[int]], namespace: str = "") -> list:
    store = SsdStore(root, Identity(fingerprint, "native", ""), model_name=f"model-{fingerprint[0]}")
    for tokens in prompts:
        for _ in store.write_steps(namespace, tuple(tokens), whole(cache_with(tokens)), True):
            pass
    return sorted(store.files.values(), key=lambda e: len(e.tokens))


def test_ls_lists_every_entry_with_its_identity(tmp_path):
    populate(tmp_path, "a" * 16, [[1, 2, 3], [7, 8, 9, 10]], namespace="adapter-1")
    populate(tmp_path, "b" * 16, [[5] * 40])
    result = runner.invoke(app, ["cache", "ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["tokens"]: r for r in json.loads(result.output)}
    assert set(rows) == {3, 4, 40}
    assert rows[3]["namespace"] == "adapter-1" and rows[3]["fingerprint"] == "a" * 16 + "-native"
    assert rows[40]["model"] == "model-b" and rows[40]["bytes"] > 0 and rows[40]["problem"] is None
    table = runner.invoke(app, ["cache", "ls", str(tmp_path)])
    assert table.exit_code == 0 and "3 files" in table.output
    assert runner.invoke(app, ["cache", "ls", str(tmp_path / "nope")]).exit_code == 2


def test_verify_names_bad_files_and_can_delete_them(tmp_path):
    good, bad = populate(tmp_path, "a" * 16, [[1, 2, 3], [4, 5, 6, 7]])
    data = bytearray(bad.path.read_bytes())
    data[-3] ^= 0xFF
    bad.path.write_bytes(bytes(data))
    result = runner.invoke(app, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1 and str(bad.path) in result.output and str(good.path) not in result.output
    assert "1 ok, 1 bad" in result.output
    result = runner.invoke(app, ["cache", "verify", str(tmp_path), "--delete-bad"])
    assert result.exit_code == 1 and not bad.path.exists() and good.path.exists()
    assert runner.invoke(app, ["cache", "verify", str(tmp_path)]).exit_code == 0


def test_verify_reads_the_tree_from_any_level(tmp_path):
    good, bad = populate(tmp_path, "a" * 16, [[1, 2, 3], [4, 5, 6, 7]])
    data = bytearray(bad.path.read_bytes())
    data[-3] ^= 0xFF
    bad.path.write_bytes(bytes(data))
    # The fingerprint directory (what the server's log names) and one namespace directory.
    for level in (bad.path.parent.parent, bad.path.parent):
        result = runner.invoke(app, ["cache", "verify", str(level)])
        assert result.exit_code == 1 and str(bad.path) in result.output and "1 ok, 1 bad" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["cache", "verify", str(empty)])
    assert result.exit_code == 0 and "no .mlxkv files" in result.output and "<fingerprint>" in result.output


def test_prune_by_age_size_and_fingerprint(tmp_path):
    old, new = populate(tmp_path, "a" * 16, [[1, 2, 3], [4, 5, 6, 7]])
    (other,) = populate(tmp_path, "b" * 16, [[9] * 8])
    week_ago = time.time() - 8 * 86400
    os.utime(old.path, (week_ago, week_ago))
    dry = runner.invoke(app, ["cache", "prune", str(tmp_path), "--older-than", "7d", "--dry-run"])
    assert dry.exit_code == 0 and f"would remove {old.path}" in dry.output and old.path.exists()
    assert runner.invoke(app, ["cache", "prune", str(tmp_path), "--older-than", "7d"]).exit_code == 0
    assert not old.path.exists() and new.path.exists() and other.path.exists()
    removed = runner.invoke(app, ["cache", "prune", str(tmp_path), "--fingerprint", "b" * 16])
    assert removed.exit_code == 0 and not other.path.exists() and new.path.exists()
    (newest,) = populate(tmp_path, "a" * 16, [[3] * 5])
    capped = runner.invoke(app, ["cache", "prune", str(tmp_path), "--max-bytes", str(newest.nbytes)])
    assert capped.exit_code == 0 and not new.path.exists()  # the least recently used goes first
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 1
    assert runner.invoke(app, ["cache", "prune", str(tmp_path)]).exit_code == 2  # nothing said
    assert runner.invoke(app, ["cache", "prune", str(tmp_path), "--older-than", "soon"]).exit_code == 2


def tree(root) -> dict:
    """A server-written tree: a shared prompt (split off the first agent's file when the second came), two
    agents below it, and one agent's next turn."""
    from tests.store.test_cold_tier import drain, tier

    t = tier(root)
    shared = list(range(100, 140))
    for tokens in (shared + [1] * 4, shared + [2] * 5, shared + [1] * 4 + [3] * 6):
        t.ram.put("", tokens, cache_with(tokens))
        drain(t)
    return {(n.start, len(n.tokens)): n.path for n in t.store.files.values()}


def test_ls_shows_each_file_under_its_parent(tmp_path):
    paths = tree(tmp_path)
    result = runner.invoke(app, ["cache", "ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    by_span = {(r["start"], r["tokens"]): r for r in rows}
    assert set(by_span) == set(paths) == {(0, 40), (40, 4), (40, 5), (44, 6)}
    root, one, two, turn = (by_span[k] for k in ((0, 40), (40, 4), (40, 5), (44, 6)))
    assert root["parent"] is None and one["parent"] == two["parent"] == root["digest"]
    assert turn["parent"] == one["digest"] and turn["end"] == 50 and turn["depth"] == 2
    assert all(r["durable"] for r in rows) and rows[0]["digest"] == root["digest"]  # parents first
    table = runner.invoke(app, ["cache", "ls", str(tmp_path)])
    assert table.exit_code == 0 and "└" in table.output and "4 files" in table.output


def test_verify_reports_a_child_whose_parent_is_missing_or_corrupt(tmp_path):
    paths = tree(tmp_path)
    data = bytearray(paths[(0, 40)].read_bytes())
    data[-2] ^= 0x01
    paths[(0, 40)].write_bytes(bytes(data))
    result = runner.invoke(app, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1 and "0 ok, 4 bad" in result.output
    assert "checksum" in result.output and result.output.count("a file above it is bad") == 3
    paths[(0, 40)].unlink()
    result = runner.invoke(app, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1 and result.output.count("is missing (unreachable)") == 2
    assert result.output.count("a file above it is bad") == 1  # the next turn, below a missing parent's child
    assert runner.invoke(app, ["cache", "verify", str(tmp_path), "--delete-bad"]).exit_code == 1
    assert not list(tmp_path.rglob("*.mlxkv"))


def test_prune_removes_whole_subtrees_never_a_needed_parent(tmp_path):
    paths = tree(tmp_path)
    week_ago = time.time() - 8 * 86400
    for path in paths.values():
        os.utime(path, (week_ago, week_ago))
    now = time.time()
    os.utime(paths[(44, 6)], (now, now))  # one agent's next turn was used: the files above it must stay
    result = runner.invoke(app, ["cache", "prune", str(tmp_path), "--older-than", "7d"])
    assert result.exit_code == 0 and "1 files" in result.output
    assert not paths[(40, 5)].exists() and all(paths[k].exists() for k in ((0, 40), (40, 4), (44, 6)))
    result = runner.invoke(app, ["cache", "prune", str(tmp_path), "--max-bytes", "1"])
    assert result.exit_code == 0 and not list(tmp_path.rglob("*.mlxkv"))
    lines = [line for line in result.output.splitlines() if line.startswith("removed")]
    assert [str(paths[k]) in line for k, line in zip(((44, 6), (40, 4), (0, 40)), lines, strict=True)] == [True] * 3


def test_old_format_files_are_named_by_verify_and_removable(tmp_path):
    import struct

    paths = tree(tmp_path)
    path = paths[(40, 5)]
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 1)
    path.write_bytes(bytes(data))
    result = runner.invoke(app, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1 and "format version 1; this mlxq reads version 2" in result.output
    assert runner.invoke(app, ["cache", "verify", str(tmp_path), "--delete-bad"]).exit_code == 1
    assert not path.exists() and runner.invoke(app, ["cache", "verify", str(tmp_path)]).exit_code == 0
