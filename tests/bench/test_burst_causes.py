"""An outlier's cause, read from /stats readings taken while it waited: plain data, no server."""

from __future__ import annotations

from mlxq.bench.burst_causes import Record, Sample, explain, mark_outliers, overall_summary, wave_summary

GB = 10**9


def reading(t: float, **kw) -> Sample:
    base = dict(active=4, prefilling=0, pending=0, preempted=0, row_cap=8, kv_bytes=0, kv_budget=None,
                preemptions=0, cache_entries=1, active_bytes=10 * GB, limit_bytes=100 * GB)
    return Sample(t, **(base | kw))


def request(ttft_ms: float, queue_ms: float | None = None, cached: int = 0, wave: int = 0) -> Record:
    return Record(wave, "r", 0.0, ttft_ms, 3.0, 500, cached, 16, queue_ms)


def test_a_queued_request_is_explained_by_the_last_reading_before_its_admission():
    late = request(3000, queue_ms=2500)
    full = [reading(0.5, active=8), reading(2.4, active=6, prefilling=2), reading(2.9, active=8)]
    assert "all 8 rows were taken" in explain(late, full, 8, 4)
    assert "lowered to 2" in explain(late, [reading(2.0, active=2, row_cap=2)], 8, 4)
    assert "KV budget was full" in explain(late, [reading(2.0, kv_bytes=95, kv_budget=100)], 8, 4)
    assert "memory room" in explain(late, [reading(2.0, active_bytes=92 * GB)], 8, 4)
    assert "--prompt-concurrency 4" in explain(late, [reading(2.0, active=2, prefilling=4)], 8, 4)
    assert "preempted rows go first" in explain(late, [reading(2.0, preempted=3)], 8, 4)


def test_admitted_requests_are_explained_by_faults_or_their_own_prefill():
    faulted = [reading(0.1), reading(1.0, preemptions=2)]
    assert "2 preemptions" in explain(request(2000, queue_ms=5), faulted, 8, 4)
    assert "460 uncached prompt tokens" in explain(request(2000, queue_ms=5, cached=40), [reading(1.0)], 8, 4)


def test_outliers_are_far_from_the_waves_median_and_summaries_count_them():
    records = [request(100), request(120), request(110), request(5000, queue_ms=4800)]
    samples = [reading(4.0, active=8)]
    mark_outliers(records, samples, factor=3, min_ms=1000, batch=8, prompt_concurrency=4)
    assert [r.outlier is not None for r in records] == [False, False, False, True]
    stats = {"prompt_cache": {"entries": 5, "evictions": 0}, "batch": {"faults": {"preemptions": 0}}}
    wave = wave_summary(records, samples, 2.0, stats)
    assert wave["ttft_ms"]["max"] == 5000 and len(wave["outliers"]) == 1 and wave["out_tok_s"] == 32
    cached = [request(200, wave=1)]
    overall = overall_summary(records + cached, [wave, wave | {"out_tok_s": 40}], cold_waves=1)
    assert overall["cold_ttft_ms"]["max"] == 5000 and overall["cached_ttft_ms"]["p95"] == 200
    assert overall["ram_entries_before_eviction"] == 5 and overall["cached_out_tok_s"] == [40]
