"""--kv-quant through real servers: batched quantized rows equal the serial lane; clear start-up errors."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlxq.golden.cases import LONG, SHORT
from tests.conftest import ServerProcess

PROMPTS = [LONG, SHORT, LONG[:200], "Tell me about " + SHORT, LONG + " " + SHORT, SHORT * 3]


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0,
                                                  "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_quantized_rows_equal_the_serial_lane(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    with ServerProcess("--model", model, "--kv-quant", "4", "--batch", "1", "--prompt-cache", "0") as serial:
        expected = [complete(serial.url, p)["choices"][0]["text"] for p in PROMPTS]
        native = httpx.get(serial.url + "/stats").json()["kv"]
    with ServerProcess("--model", model, "--kv-quant", "4", "--prompt-cache", "0") as batched:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(batched.url, p)["choices"][0]["text"], PROMPTS))
        stats = httpx.get(batched.url + "/stats").json()
    assert got == expected
    assert stats["batch"]["mode"] == "batch" and stats["batch"]["submitted_rows"] == len(PROMPTS)
    assert stats["kv"]["scheme"] == native["scheme"] == "kv4g64" and stats["kv"]["layer_bits"] == [4, 4, 4, 4]
    with ServerProcess("--model", model) as plain:
        full = httpx.get(plain.url + "/stats").json()["kv"]
    assert full["scheme"] == "native" and full["bytes_per_token"] / stats["kv"]["bytes_per_token"] > 6


@pytest.mark.parametrize("arch, bits", [("gemma3_text", "8"), pytest.param("qwen3_next", "4", marks=pytest.mark.slow)])
def test_quantized_sliding_window_and_hybrid_models_batch_too(tiny_model_dirs, arch, bits):
    model = str(tiny_model_dirs[arch])
    flags = ("--kv-quant", bits, "--prompt-cache", "0")
    with ServerProcess("--model", model, "--batch", "1", *flags) as serial:
        expected = [complete(serial.url, p)["choices"][0]["text"] for p in PROMPTS]
    with ServerProcess("--model", model, *flags) as batched:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(batched.url, p)["choices"][0]["text"], PROMPTS))
        stats = httpx.get(batched.url + "/stats").json()
    assert got == expected
    assert stats["batch"]["mode"] == "batch" and stats["engine"]["placement_reasons"] == {"batchable": len(PROMPTS)}


def test_an_impossible_scheme_fails_at_start_up_naming_the_layer_and_the_fix(tiny_model_dirs):
    cmd = [sys.executable, "-m", "mlxq.cli.main", "serve", "--model", str(tiny_model_dirs["llama"]),
           "--port", "0", "--kv-quant", "8", "--kv-group-size", "128"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "layer 0: --kv-group-size 128 does not divide its head_dim 64; use --kv-group-size 64" in run.stderr
    bad = subprocess.run(cmd[:-4] + ["--kv-quant", "7"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kv-quant must be" in bad.stderr
