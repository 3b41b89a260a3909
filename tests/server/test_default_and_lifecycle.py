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
