"""`mlxq serve --config FILE.toml` (or MLXQ_CONFIG): the flags' settings from a file; flags win."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app
from tests.conftest import ServerProcess

runner = CliRunner()


def test_a_servers_settings_come_from_the_file_and_flags_override_it(tiny_model_dirs, tmp_path):
    config = tmp_path / "mlxq.toml"
    config.write_text(f'model = "{tiny_model_dirs["llama"]}"\nserved-model-name = "from-file"\n'
                      'port = 1\n'  # ServerProcess passes --port: the flag wins (port 1 would not bind)
                      'max_tokens = 7\nlog-level = "warning"\nkv-budget = "auto"\nprompt-cache = 0\n')
    with ServerProcess("--config", str(config), "--max-tokens", "3") as server:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "from-file"
        body = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon"}).json()
        assert body["usage"]["completion_tokens"] == 3  # --max-tokens on the command line beat the file's 7
        assert httpx.get(server.url + "/stats").json()["prompt_cache"]["enabled"] is False  # prompt-cache = 0


def test_mlxq_config_names_the_file_too(tmp_path):
    config = tmp_path / "env.toml"
    config.write_text("batch = 0\n")
    result = runner.invoke(app, ["serve"], env={"MLXQ_CONFIG": str(config)})
    assert result.exit_code == 2 and "--batch and --prompt-concurrency must be >= 1" in result.output


@pytest.mark.parametrize("text, message", [
    ("batchx = 3\n", "unknown key 'batchx' (did you mean 'batch'?)"),
    ("no_such_thing = 1\n", "unknown key 'no_such_thing' (keys are the flag names without --)"),
    ('port = "8080"\n', "'port' must be an integer, got a string"),
    ("log-prompts = 1\n", "'log-prompts' must be a boolean, got an integer"),
    ("temp = true\n", "'temp' must be a number, got a boolean"),
    ('log-level = "loud"\n', "'log-level' must be one of debug, info, warning, error; got 'loud'"),
    ("model = [1]\n", "'model' must be a string, got a TOML list"),
    ('batch = 2\ndecode-concurrency = 4\n', "'decode-concurrency' sets --batch a second time"),
    ("port = [\n", "not valid TOML"),
    ('adapter = "a=./a"\n', "'adapter' must be a list of strings"),
])
def test_a_bad_key_or_type_is_one_line_naming_the_file_and_key(tmp_path, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {config}: {message}" or (
        message == "not valid TOML" and result.output.startswith(f"error: {config}: not valid TOML"))


def test_repeatable_flags_are_lists_in_the_file(tmp_path):
    config = tmp_path / "adapters.toml"
    config.write_text(f'adapter = ["ok=.", "gone={tmp_path / "gone"}"]\n')
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2 and "--adapter ok=.: adapter_config.json is missing" in result.output


def test_a_missing_config_file_is_named(tmp_path):
    result = runner.invoke(app, ["serve", "--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2 and f"{tmp_path / 'nope.toml'}: cannot read the config file" in result.output
