"""What a new user reaches for: examples in --help, shell completion, progress while a model builds."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app

runner = CliRunner()


def mlxq(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxq.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, **kwargs)


def test_the_main_commands_help_shows_examples():
    for command, example in ((["--help"], "mlxq serve --model mlx-community/Qwen3-4B-4bit"),
                             (["serve", "--help"], "mlxq serve --config mlxq.toml --port 9000"),
                             (["model", "tiny", "--help"], "mlxq model tiny --arch llama --out ./tiny-llama"),
                             (["model", "pull", "--help"], "mlxq model pull mlx-community/Qwen3-4B-4bit")):
        result = runner.invoke(app, command, terminal_width=120)
        assert result.exit_code == 0 and "Examples:" in result.output and example in result.output, command


@pytest.mark.slow  # typer's completion runs the CLI in subprocesses: about 13 s
def test_shell_completion_script_and_completions():
    # typer takes the shell from the argument, not from the process's ancestors (a detached run has no shell)
    script = mlxq("--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert script.returncode == 0 and "complete -o default -F _mlxq_completion mlxq" in script.stdout
    commands = mlxq(env={"_MLXQ_COMPLETE": "complete_bash", "COMP_WORDS": "mlxq se", "COMP_CWORD": "1"})
    assert commands.stdout.split() == ["serve"]
    flags = mlxq(env={"_MLXQ_COMPLETE": "complete_bash", "COMP_WORDS": "mlxq serve --chat-t", "COMP_CWORD": "2"})
    assert sorted(flags.stdout.split()) == ["--chat-template", "--chat-template-args"]


def test_model_build_prints_start_and_end_and_stays_plain_when_piped(tmp_path):
    done = mlxq("model", "tiny", "--arch", "llama", "--out", str(tmp_path / "m"))
    assert done.returncode == 0
    assert done.stderr == f"building mlxq-tiny-llama in {tmp_path / 'm'} ...\n"
    assert done.stdout.startswith("mlxq-tiny-llama: ") and done.stdout.count("\n") == 1
    assert "\r" not in done.stdout + done.stderr and "\x1b" not in done.stdout + done.stderr


def test_model_build_draws_a_progress_bar_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.cli.main", "model", "tiny", "--arch", "llama", "--out",
                             str(tmp_path / "m")], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the child closed the terminal
            chunk = b""
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(60) == 0 and proc.stdout.read().startswith(b"mlxq-tiny-llama: ")
    assert b"mlxq-tiny-llama's model.safetensors" in seen and b"100%" in seen  # the bar's last state
