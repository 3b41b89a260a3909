"""The `mlxq` command line, through Typer's runner and as real processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app

runner = CliRunner()


def test_model_tiny_is_byte_deterministic(tmp_path):
    digests = []
    for name in ("a", "b"):
        result = runner.invoke(app, ["model", "tiny", "--arch", "gemma3_text", "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        assert "mlxq-tiny-gemma3_text" in result.output
        digests.append({f: hashlib.sha256((tmp_path / name / f).read_bytes()).hexdigest()
                        for f in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json")})
    assert digests[0] == digests[1]
    other = runner.invoke(app, ["model", "tiny", "--arch", "gemma3_text", "--out", str(tmp_path / "c"),
                                "--seed", "1"])
    assert other.exit_code == 0
    assert hashlib.sha256((tmp_path / "c" / "model.safetensors").read_bytes()).hexdigest() != \
        digests[0]["model.safetensors"]


def test_model_tiny_never_deletes_a_users_files(tmp_path):
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "notes.txt").write_text("notes")
    refused = runner.invoke(app, ["model", "tiny", "--arch", "llama", "--out", str(precious)])
    assert refused.exit_code == 2
    assert "not empty" in refused.output and "--force" in refused.output
    assert sorted(p.name for p in precious.iterdir()) == ["notes.txt", "sub"]
    forced = runner.invoke(app, ["model", "tiny", "--arch", "llama", "--out", str(precious), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (precious / "notes.txt").read_text() == "notes" and (precious / "sub").is_dir()
    assert (precious / "model.safetensors").exists()
    # A fresh directory gets normal permissions; rebuilding an mlxq model replaces its files in place.
    fresh = tmp_path / "fresh"
    assert runner.invoke(app, ["model", "tiny", "--arch", "llama", "--out", str(fresh)]).exit_code == 0
    assert fresh.stat().st_mode & 0o777 == 0o755
    (fresh / "mine.txt").write_text("kept")
    again = runner.invoke(app, ["model", "tiny", "--arch", "llama", "--out", str(fresh), "--seed", "3"])
    assert again.exit_code == 0, again.output
    assert (fresh / "mine.txt").read_text() == "kept"
    assert json.loads((fresh / "mlxq-model.json").read_text())["seed"] == 3
    file = tmp_path / "file"
    file.write_text("x")
    assert runner.invoke(app, ["model", "tiny", "--arch", "llama", "--out", str(file)]).exit_code == 2
    assert file.read_text() == "x"


def test_model_tiny_rejects_unknown_arch(tmp_path):
    result = runner.invoke(app, ["model", "tiny", "--arch", "gpt9", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "unknown arch" in result.output


def test_serve_with_missing_model_fails_fast_naming_where_it_looked(tmp_path):
    missing = tmp_path / "nope"
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not found" in proc.stderr and str(missing) in proc.stderr


def test_serve_with_uncached_repo_id_names_the_hf_cache(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", "nobody/no-such-model"],
                          capture_output=True, text=True, timeout=60, env={"HF_HOME": str(tmp_path),
                                                                          "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "Hugging Face cache" in proc.stderr and "never downloads" in proc.stderr


@pytest.mark.slow  # mlx-lm generates the golden set: about 19 s
def test_golden_gen_writes_tokens(tmp_path):
    result = runner.invoke(app, ["golden", "gen", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "serial.json").read_text())
    assert set(doc["models"]) == {"llama", "qwen3", "gemma3_text", "qwen3_next"}
    case = doc["models"]["llama"]["cases"]["greedy-short"]
    assert len(case["tokens"]) == case["case"]["max_tokens"]


def test_version_names_the_blas():
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and "BLAS:" in result.output


def test_serve_exits_1_when_the_model_fails_to_load(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(broken), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "model failed to load" in proc.stderr


def test_serve_on_a_taken_port_says_so_in_one_line():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "mlxq.cli.main", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 2
    assert f"error: port {port} is in use on 127.0.0.1; pass --port" in proc.stderr
    assert "listening" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_start_up_errors_name_the_flag_and_the_choices():
    cases = [
        (["--batch", "0"], "--batch and --prompt-concurrency must be >= 1"),
        (["--prefill-step-size", "0"], "--prefill-step-size must be >= 1"),
        (["--kv-budget", "banana"], "--kv-budget: not a byte size: 'banana'"),
        (["--prompt-cache", "lots"], "--prompt-cache: not a byte size"),
        (["--log-level", "verbose"], "debug"),  # the choices are listed
        (["--burst-window-ms", "-5"], "--burst-window-ms must be auto or 0-10000; got -5"),
        (["--burst-window-ms", "soon"], "--burst-window-ms must be auto or a number of milliseconds"),
    ]
    for args, expected in cases:
        result = runner.invoke(app, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)
        assert expected in result.output, (args, result.output)
        assert "Traceback" not in result.output
    bench = runner.invoke(app, ["bench", "serving-load", "--dataset", "foo"])
    assert bench.exit_code == 2 and "shared-prefix" in bench.output


def test_version_flag_and_command():
    flag = runner.invoke(app, ["--version"])
    assert flag.exit_code == 0 and flag.output.startswith("mlxq ")
    assert runner.invoke(app, ["version"]).output.startswith(flag.output.strip())
    assert "Usage" in runner.invoke(app, []).output  # no arguments: the help, as before
