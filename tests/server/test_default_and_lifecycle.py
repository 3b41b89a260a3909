"""`mlxq serve` with no arguments, and its process lifecycle."""

from __future__ import annotations

import signal

import httpx
import openai

from tests.conftest import ServerProcess


def test_sdk_streams_from_serve_with_no_arguments(tmp_path):
    # A fresh cache dir: the embedded default model is built on first use.
    with ServerProcess(env={"MLXQ_CACHE_DIR": str(tmp_path)}) as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert models[0]["id"] == "mlxq-default-llama"
        # Room for a real agent's first turn (Claude Code's is ~44k of this tokenizer's tokens).
        assert httpx.get(server.url + "/stats").json()["model"]["context_length"] == 65536
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=models[0]["id"], messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, stream=True
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        log = server.proc.stdout.read()
    assert "embedded default model" in log
    assert "BLAS:" in log
    assert (tmp_path / "models").is_dir()


def test_sigterm_lets_in_flight_streams_finish_then_exits_0(tiny_model_dirs):
    import threading

    server = ServerProcess("--model", str(tiny_model_dirs["llama"]), "--shutdown-timeout", "30")
    with server:
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        client.join(60)
        assert server.proc.wait(60) == 0
    # The request that was running when the signal came completed in full.
    assert lines[-1] == "data: [DONE]"
    assert '"completion_tokens": 1500' in lines[-2]  # the usage chunk
    assert '"finish_reason": "length"' in lines[-3]


def _long_stream(server, lines: list, started) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 60000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def _stop_during_a_stream(tiny_model_dirs, grace: str, signals: list) -> tuple[list[str], str, float]:
    import threading
    import time

    server = ServerProcess("--model", str(tiny_model_dirs["llama"]), "--shutdown-timeout", grace,
                           "--max-tokens-policy", "clamp")
    with server:
        lines: list[str] = []
        started = threading.Event()
        client = threading.Thread(target=_long_stream, args=(server, lines, started))
        client.start()
        assert started.wait(30)
        sent = time.monotonic()
        for sig in signals:
            server.proc.send_signal(sig)
            time.sleep(0.5)
        client.join(60)
        ended = time.monotonic() - sent
        assert server.proc.wait(60) == 0
        log = server.proc.stdout.read()
    return lines, log, ended


def test_shutdown_deadline_ends_a_stream_with_an_error_event_then_done(tiny_model_dirs):
    lines, log, _ = _stop_during_a_stream(tiny_model_dirs, "3", [signal.SIGINT])
    assert "waiting up to 3 s for 1 in-flight request (Ctrl-C again to end it now)" in log
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "shutting down" in lines[-2]
    assert "Traceback" not in log and "Cancel" not in log  # uvicorn never had to cancel a task
    assert "finish_reason=cancelled" in log  # the request log says how it ended


def test_second_ctrl_c_ends_streams_now_and_still_exits_0(tiny_model_dirs):
    lines, log, ended = _stop_during_a_stream(tiny_model_dirs, "60", [signal.SIGINT, signal.SIGINT])
    assert ended < 30  # not the 60 s grace period
    assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
    assert "Traceback" not in log
