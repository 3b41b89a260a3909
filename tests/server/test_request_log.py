"""A request log line stays one line: a prompt cannot forge lines or send terminal escapes."""

from __future__ import annotations

import json
import time

import httpx

from mlxq.server.request_log import json_line, plain_value
from tests.conftest import ServerProcess

FORGED = "hi\n2026-01-01 00:00:00 INFO mlxq.requests: id=forged lane=batch\r\x1b[2J\x1b]0;owned\x07\u2028\u202e end"


def test_plain_log_with_prompts_escapes_control_characters(tiny_model_dirs):
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-prompts") as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": FORGED, "max_tokens": 2})
        assert r.status_code == 200
        server.stop()
        logs = server.proc.stdout.read()
    request_lines = [line for line in logs.splitlines() if "mlxq.requests:" in line]
    assert len(request_lines) == 1, request_lines  # the forged line did not become a line of its own
    (line,) = request_lines
    assert "id=forged" in line and "\\n2026-01-01" in line  # the text is there, escaped, inside the quotes
    assert not any(c in logs for c in "\x1b\x07\r\u2028\u202e")
    fields, prompt = line.split(' prompt="', 1)
    assert fields.count(" id=") == 1 and prompt.endswith(' end"')  # the forged field is inside the quotes


def test_plain_values():
    assert plain_value("stop") == "stop" and plain_value(3) == "3" and plain_value(None) == "None"
    assert plain_value("") == '""'
    assert plain_value('a b="c"\\') == r'"a b=\"c\"\\"'
    assert plain_value("\x00\x9b\ud800") == r'"\x00\x9b\ud800"'


def test_json_lines_escape_what_a_terminal_would_act_on():
    line = json_line({"prompt": "é\n\x1b\x85\u2028\ud800"})
    assert line == '{"prompt": "é\\n\\u001b\\u0085\\u2028\\ud800"}'
    assert json.loads(line)["prompt"] == "é\n\x1b\x85\u2028\ud800"


def test_json_log_times_each_request_from_its_headers_read_to_its_route(tiny_model_dirs):
    """Two requests on one kept-alive connection: each is stamped when the event loop read its own headers,
    before its route began, on the client's monotonic clock."""
    windows = []
    with ServerProcess("--model", str(tiny_model_dirs["llama"]), "--log-format", "json") as server:
        with httpx.Client() as client:
            for _ in range(2):
                sent = time.monotonic()
                r = client.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                assert r.status_code == 200
                windows.append((sent, time.monotonic()))
        server.stop()
        logs = server.proc.stdout.read()
    lines = [json.loads(line[line.index("{"):]) for line in logs.splitlines() if '"parse_ms"' in line]
    assert len(lines) == 2
    for fields, (sent, answered) in zip(lines, windows, strict=True):
        assert sent <= fields["read_monotonic_s"] <= fields["received_monotonic_s"] <= answered
