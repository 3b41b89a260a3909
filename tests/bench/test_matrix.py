"""`mlxq bench matrix features` against real servers, and its gates on known-bad outputs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlxq.bench.matrix import Cell, _gate_logprobs, _gate_reference
from mlxq.bench.metrics import RequestRecord
from mlxq.cli.main import app


@pytest.mark.slow  # six benchmark cells, each with its own server: about 23 s on two cores
def test_matrix_runs_six_cells_and_gates_pass(tiny_model_dirs, tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    result = CliRunner().invoke(app, [
        "bench", "matrix", "features", "--model", str(tiny_model_dirs["llama"]), "--requests", "4",
        "--concurrency", "2", "--max-tokens", "12", "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    cells = {c["cell"]: c for c in json.loads(out.read_text())["cells"]}
    assert list(cells) == ["plain-greedy", "shared-prefix", "stop-seeded", "quantized-kv", "logprobs", "mixed"]
    for cell in cells.values():
        assert cell["status"] == "pass", cell
        assert cell["ttft_ms"]["p50"] > 0 and cell["output_throughput_tok_s"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def record(text: str, finish: str = "length", logprobs=None) -> RequestRecord:
    return RequestRecord(sent_at=0.0, done_at=1.0, output_text=text, finish_reason=finish, logprobs=logprobs or [])


def test_reference_gate_catches_differences_and_leaked_stops():
    cell = Cell("c", [{"stop": ["zz"]}, {}], "reference")
    assert _gate_reference(cell, [record("a"), record("b")], [record("a"), record("b")]) == []
    problems = _gate_reference(cell, [record("a zz"), record("b", "stop")], [record("a zz"), record("b")])
    assert any("stop string" in p for p in problems)
    assert any("differs" in p for p in problems)


def test_logprob_gate_catches_malformed_entries():
    good = {"logprob": -0.5, "top_logprobs": [{"logprob": -0.5}, {"logprob": -1.0}, {"logprob": -2.0}]}
    bad = {"logprob": -1.0, "top_logprobs": [{"logprob": -0.5}, {"logprob": -1.0}, {"logprob": -2.0}]}
    assert _gate_logprobs([record("x", logprobs=[good])]) == []
    assert _gate_logprobs([record("x", logprobs=[bad])])
    assert _gate_logprobs([record("x")])  # no logprobs at all
