"""`mlxq serve --chat-template FILE_OR_TEXT --chat-template-args JSON`, as mlx_lm.server names them.

The prompt the server builds is the one mlx-lm builds with the same template
(``mlx_lm.load(..., tokenizer_config={"chat_template": ...})``) and the same variables;
a request's ``chat_template_kwargs`` win over the server's args, and the args obey the
same allow-list as a request's kwargs.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import mlx_lm
import pytest
from typer.testing import CliRunner

from mlxq.cli.main import app
from mlxq.golden.cases import CASES
from mlxq.golden.oracle import oracle_tokens
from tests.conftest import ServerProcess

TEMPLATE = ("{%- for message in messages %}[{{ message.role | upper }} {{ mood }}] {{ message.content }}\n"
            "{%- endfor %}{%- if add_generation_prompt %}[ASSISTANT {{ mood }}]{%- endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(TEMPLATE)
    return path


def _oracle(model_dir, **kwargs) -> tuple[int, str]:
    """(prompt tokens, greedy text) as mlx-lm gives them with TEMPLATE (text through mlx-lm's streaming
    detokenizer, as mlx_lm.server sends it)."""
    model, tokenizer = mlx_lm.load(str(model_dir), tokenizer_config={"chat_template": TEMPLATE})
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in oracle_tokens(model, tokenizer, prompt_ids, replace(CASES[0], max_tokens=6)):
        detokenizer.add_token(token)
    detokenizer.finalize()
    return len(prompt_ids), detokenizer.text


def test_the_servers_template_and_args_give_mlx_lms_tokens(tiny_model_dirs, template_file):
    model_dir = tiny_model_dirs["llama"]
    with ServerProcess("--model", str(model_dir), "--log-level", "warning", "--chat-template", str(template_file),
                       "--chat-template-args", '{"mood": "calm"}') as server:
        url = server.url + "/v1/chat/completions"
        calm = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 6}).json()
        loud = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 6,
                                     "chat_template_kwargs": {"mood": "very very loud"}}).json()
        counted = httpx.post(server.url + "/v1/messages/count_tokens",
                             json={"system": "Be brief.", "messages": MESSAGES[1:], "model": "x"}).json()
    expected_calm, expected_loud = _oracle(model_dir, mood="calm"), _oracle(model_dir, mood="very very loud")
    assert (calm["usage"]["prompt_tokens"], calm["choices"][0]["message"]["content"]) == expected_calm
    assert (loud["usage"]["prompt_tokens"], loud["choices"][0]["message"]["content"]) == expected_loud
    assert expected_loud[0] > expected_calm[0]  # the request's kwargs won
    assert counted["input_tokens"] == expected_calm[0]


def test_a_template_given_as_text_works_like_the_file(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-level", "warning", "--chat-template",
                       TEMPLATE.replace("{{ mood }}", "calm")) as server:
        body = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6}).json()
    assert (body["usage"]["prompt_tokens"], body["choices"][0]["message"]["content"]) == \
        _oracle(tiny_model_dirs["llama"], mood="calm")


@pytest.mark.parametrize("args, message", [
    (["--chat-template-args", '{"tokenize": true}'], "--chat-template-args: 'chat_template_kwargs.tokenize' is "
                                                     "not allowed"),
    (["--chat-template-args", '{"mood": {"nested": 1}}'], "--chat-template-args: 'chat_template_kwargs.mood' must "
                                                          "be a string, number, boolean or null"),
    (["--chat-template-args", "[1]"], "--chat-template-args must be a JSON object"),
    (["--chat-template-args", "{mood"], "--chat-template-args: not valid JSON"),
    (["--chat-template", "templates/missing.jinja"], "--chat-template: 'templates/missing.jinja' is neither a file "
                                                     "nor a Jinja template"),
])
def test_bad_template_flags_are_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
