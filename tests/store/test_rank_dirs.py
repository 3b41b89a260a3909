"""Rank folders of the SSD tier: tensor- and pipeline-parallel ranks keep their files apart."""

from __future__ import annotations

from mlxq.store.ssd_config import parse_rank_dir, rank_dir


def test_each_mode_names_its_rank_folders_and_both_parse():
    assert rank_dir(1, 2) == "tp2-rank1" and rank_dir(0, 4, "pipeline") == "pp4-rank0"
    assert parse_rank_dir("tp2-rank1") == (1, 2) and parse_rank_dir("pp4-rank0") == (0, 4)
    assert parse_rank_dir("pp2-rank2") is None and parse_rank_dir("xp2-rank0") is None
