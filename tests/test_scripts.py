"""The GPU measurement scripts run end to end on the CPU on a small model.

They are run by hand on a lent GPU with minutes of device time: a script that
breaks there (a wrong argument, a renamed field) wastes scarce device time. These
runs are short versions of the same commands; the numbers are not checked,
the documents they write are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxq.models.tiny import build_tiny_model

# Each test runs a measurement script end to end, most with a server: about 6 minutes in all on two cores.
# Run them (`pytest -m slow tests/test_scripts.py`) before a script goes to a GPU.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    """The 33M "small" preset: its vocabulary holds the scripts' synthetic prompt ids."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("bench-models") / "small", preset="small")


def run(script: str, *args: str, env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_ttft_probe(small_model, tmp_path):
    run("ttft_probe.py", "--model", str(small_model), "--lengths", "40,46", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "ttft-probe.json").read_text())
    assert [r["length"] for r in doc["rows"]] == [40, 46]
    assert set(doc["median_ms"]) == {"mlxq_first", "floor_first", "mlxq_again", "floor_again"}
    assert doc["token0_in_decode"] is False  # the CPU's placement, as the server picks it


def test_thread_probe(small_model, tmp_path):
    out = tmp_path / "thread.json"
    run("thread_probe.py", "--model", str(small_model), "--rounds", "2", "--tokens", "8", "--json", str(out))
    doc = json.loads(out.read_text())
    assert len(doc["runs"]["main"]) == len(doc["runs"]["thread"]) == 2
    assert all(r["step_ms"] > 0 for r in doc["runs"]["thread"])


def test_profile_step_anatomy(small_model, tmp_path):
    run("profile_step.py", "--model", str(small_model), "--rows", "2", "--prompt-tokens", "16",
        "--max-tokens", "4", "--anatomy", "8", "--out", str(tmp_path))
    anatomy = json.loads((tmp_path / "anatomy.json").read_text())
    # Nothing is rerouted on the CPU: all three attention paths are MLX's, float32 ones agree.
    assert anatomy["greedy_agreement"]["routed_vs_mlx_lm"]["8"] == 1.0
    assert json.loads((tmp_path / "profile.json").read_text())["rows"] == 2


def test_gpu_bench_b1_phase(tmp_path):
    run("gpu_bench.py", "--preset", "small", "--phases", "build,b1", "--rounds", "1", "--max-tokens", "8",
        "--out", str(tmp_path), env={"MLXQ_BENCH_MODELS": str(tmp_path / "models")})
    doc = json.loads((tmp_path / "gpu-bench-small.json").read_text())
    b1 = doc["b1"]
    assert set(b1["tok_s_median"]) == {"mlx_lm_stream_generate", "mlxq_serial", "mlxq_batch_lane"}
    assert b1["batch_lane_decode_timing"][0]["steps"] >= 7


def test_gpu_bench_isolated_http_sweep(small_model, tmp_path):
    """Both servers, each alone, two levels: the sweep's documents and mlxq's server-side split
    (--batch is the top level, 2: the batch lane, whose decode steps are timed)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "small").symlink_to(small_model)
    run("gpu_bench.py", "--preset", "small", "--phases", "http", "--isolate", "--concurrency", "1,2",
        "--max-tokens", "8", "--prompt-words", "20", "--out", str(tmp_path), env={"MLXQ_BENCH_MODELS": str(models)})
    doc = json.loads((tmp_path / "gpu-bench-small.json").read_text())
    for level in ("1", "2"):
        both = doc["http"][level]
        assert both["a"]["completed"] == both["b"]["completed"] == 16
        assert both["a"]["failed"] == 0
    split = doc["http_server_side_ms"]["1"]
    assert split["time_to_first_token_seconds"] > 0
    assert split["decode_step"]["steps"] >= 16 * 7  # one per token after each request's first
    assert abs(sum(split["decode_step"]["busy_share"].values()) - 1) < 1e-3


def test_server_gap_probe(small_model, tmp_path):
    """Every layer from the bare scheduler to a real HTTP server, each measured with its step split."""
    run("server_gap_probe.py", "--model", str(small_model), "--rounds", "1", "--requests", "2", "--tokens", "8",
        "--prompt-tokens", "24", "--prompt-words", "20", "--switch-interval", "0.05", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "server-gap-probe.json").read_text())
    assert set(doc["summary"]) == {"stream_generate", "scheduler", "engine", "engine+loop", "engine+loop si=50ms",
                                   "http"}
    for name, runs in doc["runs"].items():
        assert runs[0]["tok_s"] > 0, name
        if name != "stream_generate":  # mlx-lm's loop has no split
            assert runs[0]["split"]["steps"] >= 2 * 7, name  # two requests' decode steps, each read from its source


def test_shared_prefix_micro(tmp_path):
    out = tmp_path / "micro.json"
    run("shared_prefix_micro.py", "--shape", "smoke", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["float32_check"] < 1e-5
    shared, own = doc["rows"]
    assert shared["diff"] < 1e-5 and shared["shared_ops_ms"] > 0
    assert own["prefix"] == 0 and own["shared_ops_ms"] is None  # nothing to share
    run("shared_prefix_micro.py", "--quantized-check")


def test_shared_prefix_step(small_model, tmp_path):
    out = tmp_path / "step.json"
    run("shared_prefix_step.py", "--model", str(small_model), "--cases", "3x40+5", "--steps", "2",
        "--prefill-cases", "3x40+6", "--prefill-reps", "1", "--json", str(out),
        "--logits-out", str(tmp_path / "logits"))
    case, prefill = json.loads(out.read_text())["cases"]
    assert (tmp_path / "logits-3x40+6-ops.npy").exists()  # one per prefill case and path
    assert case["copies_ms"] > 0 and case["shared_ops_ms"] > 0 and case["auto_path"] == "ops"
    assert case["shared_ops_logit_diff"] < 1e-4  # float32 on the CPU
    assert prefill["ops_ms"] > 0 and prefill["ops_whole_logit_diff"] == 0.0
    assert prefill["copies_logit_diff"] < 1e-4 and "mma_prefill_ms" not in prefill  # no kernel on the CPU


def test_prefix_kernel_micro_reports_each_variant(tmp_path):
    """On the CPU every variant fails alone (no CUDA backend) and the others still run."""
    out = tmp_path / "kernel.json"
    run("prefix_kernel_micro.py", "--cases", "prefill:2x100+3,decode:2x64+1", "--heads", "8:2:64",
        "--variants", "d,w4,t4.2.32.3.1,t4.2.64.2.1.0.32@528", "--reps", "1", "--json", str(out),
        env={"PYTHONPATH": str(SCRIPTS.parent)})
    prefill, decode = json.loads(out.read_text())["results"]
    assert prefill["case"] == "prefill:2x100+3" and decode["gflop"] >= 0
    assert list(decode["variants"]) == ["d", "w4", "t4.2.32.3.1", "t4.2.64.2.1.0.32@528"]
    assert all("CUDA" in row["failed"] for row in decode["variants"].values())


def test_shared_prefix_serving(small_model, tmp_path):
    run("shared_prefix_serving.py", "--model", str(small_model), "--parts", "cached:120:2:2:2,fresh:30:2:2:1@on",
        "--max-tokens", "4", "--batch", "4", "--memory-limit", "2GB", "--out", str(tmp_path),
        "--scratch", str(tmp_path / "scratch"))
    doc = json.loads((tmp_path / "serving.json").read_text())
    cached, alone = doc["parts"]
    assert "error" not in alone and [r["completed"] for r in alone["on"]] == [2] and alone["off"] == [], alone
    for part in (cached,):
        assert "error" not in part, part
        assert [r["completed"] for r in part["on"] + part["off"]] == [2, 2, 2, 2], part
        assert part["sharing_after"]["mode"] == "on"
        # The system prompt is kept: the second round finds it in the prompt cache (both servers).
        for side in ("on", "off"):
            first, second = (r["cached_token_ratio"] for r in part[side])
            assert second > first, part[side]
        # The on server's request log, per round: the first token's time in phases.
        assert len(part["on_phases_ms"]) == 2 and all(r["ttft"]["p95"] > 0 for r in part["on_phases_ms"])


def test_ssd_restore_measurements(tmp_path):
    run("gpu_bench.py", "--preset", "small", "--phases", "build,restore", "--restore-lengths", "300",
        "--restore-placements", "host,device", "--out", str(tmp_path),
        env={"MLXQ_BENCH_MODELS": str(tmp_path / "models")})
    restore = json.loads((tmp_path / "gpu-bench-small.json").read_text())["restore"]["300"]
    assert restore["files"] >= 1
    assert [restore[f"page_cache_cached_{p}"]["ssd_cached_tokens"] for p in ("host", "device")] == [300, 300]
    assert all(run["same_token_as_ram_hit"] for run in restore.values() if isinstance(run, dict))
    run("bench_ssd.py", "--preset", "small", "--parts", "restore-speed", "--restore-shape", "small",
        "--restore-tokens", "400", "--rounds", "1", "--out", str(tmp_path / "ssd"))
    speed = json.loads((tmp_path / "ssd" / "ssd.json").read_text())["restore_speed"]
    assert speed["files"] == 2 and speed["store_gb_s"] > 0
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_restore_stages.py"), "--tokens", "64",
                           "--threads", "2", "--paths", "zeros,load-ver"], capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and [line["path"] for line in lines] == ["zeros", "load-ver"], done.stderr
    assert all(line[r]["read_s"] > 0 for line in lines for r in ("round0", "round1"))


def output_of(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_profile_grammar_step():
    """The decode step of free, grammar and mixed batches on the embedded model: grammar mixes compute masks."""
    lines = [json.loads(line) for line in output_of("profile_grammar_step.py", "--rows", "2", "--steps", "3",
                                                    "--token0-in-decode", "0").splitlines()]
    assert [line["mix"] for line in lines] == ["free", "grammar", "mixed"]
    assert all(line["rows_per_step"] == 2 and line["ms_per_step"] > 0 for line in lines)
    assert lines[0]["mask_ms_per_step"] == 0 and lines[1]["mask_ms_per_step"] > 0


def test_bench_structured():
    """One short round per mix over HTTP: each mix's row is printed, with masks only where grammars run."""
    out = output_of("bench_structured.py", "--concurrency", "2", "--rounds", "1", "--seconds", "0.5")
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "mix (c=2)" not in line}
    assert set(rows) == {"free", "grammar", "mixed"}
    assert rows["free"][1] == "1.00x" and int(rows["free"][6]) == 0
    assert int(rows["grammar"][6]) > 0 and int(rows["mixed"][6]) > 0


def test_bench_checkpoints(small_model, tmp_path):
    run("bench_checkpoints.py", "--model", str(small_model), "--tokens", "24", "--interval", "8", "--rounds", "1",
        "--together", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "checkpoints-b1-r1-together.json").read_text())
    mode = doc["together"]  # the summary holds one entry per mode that ran
    assert set(mode["decode_tok_s_median"]) == {"on", "off"} and mode["checkpoints_written"] >= 1


def test_bench_checkpoints_rounds(small_model, tmp_path):
    """The batch lane, rounds alternating on/off: each round's ratio, decode steps and links."""
    run("bench_checkpoints.py", "--model", str(small_model), "--tokens", "24", "--interval", "8", "--rounds", "2",
        "--rows", "2", "--batch", "2", "--out", str(tmp_path))
    mode = json.loads((tmp_path / "checkpoints-b2-r2-sequential.json").read_text())["sequential"]
    assert [r["order"] for r in mode["rounds"]] == [["on", "off"], ["off", "on"]]
    for r in mode["rounds"]:
        assert r["on"]["step"]["steps"] >= 20 and r["off"]["step"]["steps"] >= 20
        assert r["on"]["checkpoints"]["written"] >= 4 and r["on"]["checkpoints"]["dropped"] == 0
        assert r["on_over_off"] > 0
        assert r["on"]["settle"]["durable"] is True and r["off"]["settle"]["durable"] is True  # flushed after each load
    assert mode["on_over_off"]["n"] == 2 and mode["on_over_off"]["min"] <= mode["on_over_off"]["median"]
    assert mode["checkpoints_written"] == sum(r["on"]["checkpoints"]["written"] for r in mode["rounds"])


def test_checkpoint_step_probe(small_model, tmp_path):
    run("checkpoint_step_probe.py", "--model", str(small_model), "--rows", "2", "--tokens", "20", "--interval", "8",
        "--variants", "off,on,nohold,keep,nowrite+nohost,sync,ops,hostonly,nodisk,nohash,pyhash", "--warmup", "off",
        "--out", str(tmp_path))
    runs = {entry["variant"]: entry for entry in json.loads((tmp_path / "probe.json").read_text())}
    writers = ("hostonly", "nodisk", "nohash", "pyhash")
    assert set(runs) == {"off", "on", "nohold", "keep", "nowrite+nohost", "sync", "ops", *writers}
    assert runs["off"]["staging_steps"] == 0 and runs["off"]["links"] == {}
    for name in ("on", "nohold", "keep", "nowrite+nohost", "sync", "ops", *writers):
        assert runs[name]["links"]["written"] >= 2 and runs[name]["links"]["dropped"] == 0, runs[name]
        assert runs[name]["staging_steps"] >= 2 and runs[name]["steps"] >= 18
        assert runs[name]["parts"]["queue_copies"]["calls"] == runs[name]["staging_steps"], runs[name]
    assert set(runs["off"]["parts"]) == {"clear_cache"}


def test_profile_adapter_step():
    """One decode step per routing (base, one adapter, mixed, mixed with base) on the embedded model."""
    out = output_of("profile_adapter_step.py", "--rows", "2", "--steps", "2", "--rank", "4", "--context", "16")
    rows = [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| 2 |")]
    assert rows == ["base", "one", "mixed", "mixed+base"]


def test_bench_adapters(tmp_path):
    """One short round per mix over HTTP against a server with two adapters; the JSON has every mix."""
    output_of("bench_adapters.py", "--concurrency", "2", "--rounds", "1", "--seconds", "0.5", "--rank", "4",
              "--warmup-seconds", "0.2", "--max-tokens", "4", "--out", str(tmp_path / "adapters.json"))
    mixes = json.loads((tmp_path / "adapters.json").read_text())["levels"]["2"]
    assert set(mixes) == {"base", "one", "mixed", "mixed+base"} and mixes["base"]["vs_base"] == 1.0


def test_agents_burst_times_every_request_and_names_each_outliers_cause(small_model, tmp_path):
    # Every request counts as an outlier here (factor 0), so every cause path runs on real readings.
    run("agents_burst.py", "--model", str(small_model), "--agents", "3", "--waves", "2", "--prefix-words", "80",
        "--question-words", "8", "--max-tokens", "24", "--batch", "2", "--outlier-factor", "0",
        "--outlier-min-ms", "0", "--poll-ms", "20", "--client-procs", "2", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["waves"]) == 2 and summary["overall"]["cached_ttft_ms"]["p95"] > 0
    for wave in summary["waves"]:
        assert wave["requests"] == 3 and wave["ttft_ms"]["p95"] > 0 and wave["ram_tier"]["entries"] >= 1
        assert len(wave["outliers"]) == 3 and all(o["cause"] for o in wave["outliers"])
    assert summary["waves"][1]["cached_share"] > 0.5  # the second wave found the system prompt cached
    records = json.loads((tmp_path / "requests.json").read_text())
    assert len(records) == 6 and all(r["queue_ms"] is not None and r["parse_ms"] > 0 for r in records)
    # The client's first-token time outside the engine: the server's parse, and the HTTP rest (never below 0).
    outside = summary["overall"]["cached_outside_engine"]
    assert outside["parse_ms"]["p50"] > 0 and outside["http_ms"]["p50"] >= 0
    # ... the HTTP rest split on this host's monotonic clock: the request's way in, and token 0's way out.
    assert outside["send_ms"]["p50"] > 0 and outside["back_ms"]["p50"] >= 0
    # ... and the way in split: the client's part, the kernel to the server's loop, the loop to the route.
    assert outside["client_ms"]["p50"] >= 0 and outside["wire_ms"]["p50"] >= 0 and outside["route_ms"]["p50"] >= 0
    assert all(r["phases_ms"]["join"] >= 0 and "lease" in r["phases_ms"] for r in records)  # the request log's
    for phase in ("lease", "join"):
        assert summary["waves"][1]["ttft_phases_ms"][phase]["p95"] >= 0
        assert summary["overall"]["cached_ttft_phases_ms"][phase]["p50"] >= 0
    # Three agents on two rows: one of them queued for a row while the others decoded, and the report says so.
    assert any("rows were taken" in o["cause"] for w in summary["waves"] for o in w["outliers"])


def test_burst_tail_prefill_times_each_stage(small_model, tmp_path):
    run("burst_tail_prefill.py", "--model", str(small_model), "--rows", "3", "--prefix", "64", "--rounds", "1",
        "--out", str(tmp_path / "probe.json"))
    probe = json.loads((tmp_path / "probe.json").read_text())
    for stage in ("merge_ms", "forward_ms", "rows_moved_by_gather_ms", "rows_moved_by_slices_ms"):
        assert len(probe[stage]) == 1 and probe[stage][0] >= 0


def test_prefix_gather_bench(tmp_path):
    out = tmp_path / "gather.json"
    run("prefix_gather_bench.py", "--rows", "3", "--prefix", "40", "--layers", "2", "--heads", "2", "--dim", "16",
        "--repeats", "2", "--take", "--pool", "--out", str(out))
    doc = json.loads(out.read_text())
    paths = ("kernel", "kernel_pool", "take")
    assert set(doc["cases"]) == {f"{case}/{path}" for case in ("off", "auto") for path in paths}
    assert all(case["best_ms"] > 0 for case in doc["cases"].values())


def test_burst_admit_probe(small_model, tmp_path):
    out = tmp_path / "admit.json"
    run("burst_admit_probe.py", "--model", str(small_model), "--rows", "3", "--prefix", "40", "--layers", "2",
        "--rounds", "2", "--out", str(out))
    doc = json.loads(out.read_text())
    assert [r["prefix"] for r in doc["results"]] == [40] and len(doc["results"][0]["admit_ms"]) == 2


def test_burst_step_probe_timeline(small_model, tmp_path):
    out = tmp_path / "probe.json"
    run("burst_step_probe.py", "--model", str(small_model), "--rows", "3", "--prefix", "40", "--rounds", "3",
        "--sharing", "on", "--stored-head", "2", "--timeline", "--out", str(out))
    rounds = json.loads(out.read_text())["on"]
    timed = [r for r in rounds if not r["fenced"]]
    assert len(timed) == 2 and all(r["timeline"] for r in timed)
    stages = [row["stage"].strip() for row in timed[-1]["timeline"]]
    assert {"step", "model(prefill)", "model(decode)", "_emit"} <= set(stages), stages
    assert all(r["timeline"] is None for r in rounds if r["fenced"])


def test_bench_checkpoint_writer(tmp_path):
    run("bench_checkpoint_writer.py", "--arrays", "4", "--array-kb", "128", "--rate", "20", "--seconds", "0.3",
        "--phases", "1", "--writer", "both", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "checkpoint-writer.json").read_text())
    assert set(doc["links_written_per_s"]) == {"file", "steps"}
    assert all(rate > 0 for rate in doc["links_written_per_s"].values()), doc
    assert doc["file_writer_over_alone"] > 0 and doc["steps_writer_over_alone"] > 0


def test_serve_in_turn_starts_one_server_per_mode_in_turn(small_model, tmp_path):
    run("serve_in_turn.py", "--model", str(small_model), "--modes", "off,auto", "--parts", "cached:120:2:2:2",
        "--max-tokens", "4", "--batch", "4", "--memory-limit", "2GB", "--out", str(tmp_path),
        "--scratch", str(tmp_path / "scratch"))
    doc = json.loads((tmp_path / "serve_in_turn.json").read_text())
    assert [s["mode"] for s in doc["servers"]] == ["off", "auto"]
    for server in doc["servers"]:
        assert server["ready_s"] > 0 and server["first_request_s"] > 0
        assert server["shared_prefix"]["mode"] == server["mode"]
        (part,) = server["parts"]
        assert "error" not in part and [r["completed"] for r in part["rounds"]] == [2, 2], part
    assert doc["servers"][1]["shared_prefix"]["declined"].startswith("auto: sharing measured no gain")
    assert len(doc["comparison"]) == 3  # the part, then each server's start-up


def test_shared_prefix_checks_runs_without_a_device():
    done = subprocess.run([sys.executable, str(SCRIPTS / "shared_prefix_checks.py")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(SCRIPTS.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["step"] for line in done.stdout.splitlines()] == [
        "device", "layout", "default_extra", "layout_again"]


def test_burst_timeline_groups_a_wave_by_forward(tmp_path):
    """Two waves read from a JSON request log: each request placed on its wave's axis, the rows
    whose forward started together as one group (the second wave's tails in two forwards)."""
    def record(received: float, queue: float, wait: float, prefill: float, ttft: float) -> str:
        return "log prefix " + json.dumps({
            "id": f"r{received}", "lane": "continuous", "received_monotonic_s": received, "parse_ms": 1.0,
            "queue_ms": queue, "ttft_ms": ttft, "ttft_lease_ms": 0.5, "ttft_wait_ms": wait,
            "ttft_prefill_ms": prefill, "ttft_first_ms": 20.0})

    lines = [record(10.0, 0.0, 0.5, 100.0, 130.0),
             record(20.000, 5.0, 50.0, 300.0, 380.0), record(20.040, 1.0, 14.0, 300.0, 340.0),
             record(20.100, 280.0, 9.0, 100.0, 415.0),
             '{"level": "info", "message": "not a request"}']
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "timeline.json"
    run("burst_timeline.py", str(log), "--json", str(out))
    first, second = json.loads(out.read_text())
    assert first["requests"] == 1 and len(first["groups"]) == 1
    assert second["requests"] == 3
    assert [g["rows"] for g in second["groups"]] == [2, 1]
    together, late = second["groups"]
    assert together["forward"] == [56.5, 356.5]  # parse 1 + queue 5 + lease 0.5 + wait 50, then 300
    assert together["received"] == [0.0, 40.0]
    assert late["token0"] == [516.0, 516.0]  # read at 100, parsed 1, ttft 415
    assert second["last_token0_ms"] == 516.0


def test_packed_tails_forward_compares_both_ways(small_model, tmp_path):
    out, fresh = tmp_path / "packed.json", tmp_path / "fresh.json"
    run("packed_tails_forward.py", "--model", str(small_model), "--cases", "4x40+3-9,3x40+5", "--reps", "2",
        "--json-out", str(out))
    ragged, equal = json.loads(out.read_text())["cases"]
    assert ragged["padding_share"] > 0 and equal["padding_share"] == 0 and equal["tokens"] == 15
    for case in (ragged, equal):  # float32 on the CPU: the packed forward is the padded one
        assert case["max_logit_diff"] == 0.0 and case["argmax_agree"] == 1.0 and case["packed_ms"] > 0
    run("packed_tails_forward.py", "--model", str(small_model), "--cases", "4x40+3-9", "--reps", "2", "--fresh",
        "--json-out", str(fresh))
    assert len(json.loads(fresh.read_text())["cases"][0]["packed_all_ms"]) == 2
