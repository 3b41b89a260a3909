"""A server's JSON request log read back into rounds and phases (mlxq/bench/request_phases.py)."""

from __future__ import annotations

import json

from mlxq.bench.request_phases import logged_requests, round_summary, split_rounds
from mlxq.engine.types import FinishReason, Request, RequestDone, SamplingParams, Usage
from mlxq.server.request_log import RequestLogger


def _done(request_id: str, received: float, ttft_s: float, phases: dict[str, float] | None) -> RequestDone:
    request = Request(request_id, [1, 2, 3], SamplingParams(), 4)
    request.received_at = received
    usage = Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=0, queue_s=0.001, ttft_s=ttft_s,
                  decode_s=0.1, parse_s=0.002, ttft_phases_ms=phases)
    return RequestDone(request, "continuous", FinishReason.LENGTH, usage)


def test_rounds_from_the_servers_own_log_lines(tmp_path):
    # Lines as the server writes them (server/request_log.py, JSON), other log lines between them.
    path = tmp_path / "server.log"
    logger = RequestLogger("json")
    lines = ['{"level": "info", "message": "ready"}']
    # Two rounds of one warm-up and two requests each, written out of arrival order.
    arrivals = [("w1", 1.0, None), ("a", 2.0, {"wait": 5.0}), ("b", 2.1, {"wait": 7.0}),
                ("w2", 3.0, None), ("c", 4.0, {"wait": 1.0, "prefill": 2.0}), ("d", 4.1, {"wait": 3.0})]
    for request_id, received, phases in reversed(arrivals):
        lines.append(json.dumps(logger.record(_done(request_id, received, 0.5, phases))))
    path.write_text("\n".join(lines) + "\n")
    rounds = split_rounds(logged_requests(path), per_round=2, warmup=1)
    assert [[r["id"] for r in records] for records in rounds] == [["a", "b"], ["c", "d"]]
    second = round_summary(rounds[1])
    assert second["ttft"] == {"p50": 500.0, "p95": 500.0} and second["parse"]["p95"] == 2.0
    assert second["wait"]["p95"] == 3.0 and second["prefill"] == {"p50": 2.0, "p95": 2.0}  # only c had it
    # From a byte offset on: what a later part's requests wrote.
    offset = len(lines[0]) + 1
    assert [r["id"] for r in logged_requests(path, offset)] == [a[0] for a in reversed(arrivals)]
    assert logged_requests(tmp_path / "missing.log") == []
