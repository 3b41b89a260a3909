"""Prometheus metrics, named like vLLM's where the concept is the same.

vLLM exports ``vllm:<name>``; mlxq exports ``mlxq:<name>`` with the same
``<name>`` and meaning, so a dashboard moves over by changing the prefix:

- gauges: num_requests_running (decoding or prefilling rows, or the serial
  request), num_requests_waiting, kv_cache_usage_bytes (projected KV bytes
  of the batch), kv_cache_budget_bytes (--kv-budget, 0 when unset);
- mlxq's own: prompt_cache_bytes / _entries (the RAM tier), kv_bytes_per_token
  (all layers, under the KV scheme), ssd_cache_bytes / _entries / _pending
  and the counters ssd_cache_restores_total, ssd_cache_writes_total,
  ssd_cache_write_failures_total, ssd_cache_dropped_total (with --ssd-cache),
  checkpoint_files / _bytes and checkpoints_{written,written_bytes,restored,
  restored_tokens,dropped}_total (generation checkpoints, when on),
  decode_steps_total and decode_step_seconds_total{part} (build, submit,
  device_wait, output: where the batch's decode steps spend their time),
  shared_prefix_decode_steps_total (those run with a shared-prefix group),
  shared_prefix_auto_declined_joins_total (joins ``auto`` left ungrouped
  where ``on`` would have grouped rows),
  scheduler_phase_seconds_total{phase} (prefill, join, decode);
  under --tensor-parallel, distributed_world_size and
  distributed_rank_active_bytes / _peak_bytes{rank} (MLX memory per rank);
- counters: prompt_tokens_total, generation_tokens_total,
  request_success_total{finished_reason} (stop, length, cancelled = vLLM's
  "abort", error), prefix_cache_queries_total and prefix_cache_hits_total
  (in tokens: looked up / served from a prompt cache);
- histograms: time_to_first_token_seconds, inter_token_latency_seconds,
  e2e_request_latency_seconds, request_queue_time_seconds,
  request_prefill_time_seconds, request_decode_time_seconds,
  request_prompt_tokens, request_generation_tokens.

Each server has its own registry, so several servers in one process (tests)
never share counters. Counters move on the engine thread, once per finished
request (``Engine.add_observer``); gauges are read when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlxq.engine.types import RequestDone
from mlxq.server.memory_stats import memory_gauges

PREFIX = "mlxq:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class _EngineGauges:
    """A collector that reads the engine's live numbers at scrape time."""

    def __init__(self, state):
        self._state = state

    def collect(self):
        engine = self._state.engine
        scheduler = engine.scheduler
        values = {
            "num_requests_running": engine.num_running,
            "num_requests_waiting": engine.num_waiting,
            "kv_cache_usage_bytes": scheduler.projected_bytes() if scheduler else 0,
            "kv_cache_budget_bytes": engine.kv_budget_bytes or 0,
            **memory_gauges(engine),
        }
        ram = engine.prompt_cache
        if ram is not None:
            values["prompt_cache_bytes"] = ram.bytes
            values["prompt_cache_entries"] = len(ram)
        if engine.footprint is not None:
            values["kv_bytes_per_token"] = sum(layer.bytes_per_token for layer in engine.footprint.layers)
        cold = engine.cold
        if cold is not None:
            ssd = cold.as_dict()
            values.update(ssd_cache_bytes=ssd["bytes"], ssd_cache_entries=ssd["entries"],
                          ssd_cache_pending=ssd["pending"])
            for name, key in (("ssd_cache_restores", "restores"), ("ssd_cache_writes", "writes"),
                              ("ssd_cache_write_failures", "failed"), ("ssd_cache_dropped", "dropped")):
                yield CounterMetricFamily(PREFIX + name, name.replace("_", " "), value=ssd[key])
        if engine.checkpoints is not None:
            yield from _checkpoint_metrics(engine.checkpoints.store.as_dict())
        faults = engine.evaluator.counters
        yield CounterMetricFamily(PREFIX + "num_preemptions", "rows requeued after an allocation fault",
                                  value=faults.preemptions)
        yield CounterMetricFamily(PREFIX + "memory_faults", "allocation failures at an evaluation",
                                  value=faults.memory_faults)
        if scheduler is not None:
            yield from _decode_step_counters(scheduler.timing)
            yield CounterMetricFamily(PREFIX + "shared_prefix_decode_steps",
                                      "batch decode steps run with a shared-prefix group",
                                      value=scheduler.sharing_stats.steps)
            yield CounterMetricFamily(PREFIX + "shared_prefix_auto_declined_joins",
                                      "joins after which --shared-prefix-attention auto formed no group where on "
                                      "would have (the reason: /stats.batch.shared_prefix.auto_last_declined)",
                                      value=scheduler.sharing_stats.auto_declined)
            phases = CounterMetricFamily(PREFIX + "scheduler_phase_seconds",
                                         "batch scheduler wall time by phase", labels=["phase"])
            for phase, value in (("prefill", scheduler.phases.prefill_s), ("join", scheduler.phases.join_s),
                                 ("decode", scheduler.timing.step_s)):
                phases.add_metric([phase], value)
            yield phases
        if engine.lockstep is not None:
            yield from _distributed_gauges(engine.lockstep)
        for name, value in values.items():
            yield GaugeMetricFamily(PREFIX + name, name.replace("_", " "), value=value)


def _checkpoint_metrics(stats: dict):
    """Generation checkpoints: files and bytes on disk, and what was written, restored and dropped."""
    yield GaugeMetricFamily(PREFIX + "checkpoint_files", "generation checkpoint files on disk", value=stats["files"])
    yield GaugeMetricFamily(PREFIX + "checkpoint_bytes", "bytes of generation checkpoint files", value=stats["bytes"])
    for name, help_text in (("written", "checkpoint links written"),
                            ("written_bytes", "tensor bytes of checkpoint links written"),
                            ("restored", "requests resumed from a checkpoint"),
                            ("restored_tokens", "completion tokens restored instead of generated"),
                            ("dropped", "checkpoints not written (queue full, disk refused)")):
        yield CounterMetricFamily(PREFIX + "checkpoints_" + name, help_text, value=stats[name])


def _distributed_gauges(lockstep):
    """Tensor parallel: the world and each rank's MLX memory (as of the engine's last iteration)."""
    yield GaugeMetricFamily(PREFIX + "distributed_world_size", "ranks sharing the model",
                            value=lockstep.world.size)
    for name, column in (("distributed_rank_active_bytes", 0), ("distributed_rank_peak_bytes", 1)):
        gauge = GaugeMetricFamily(PREFIX + name, name.replace("_", " "), labels=["rank"])
        for rank, memory in enumerate(lockstep.rank_memory):
            gauge.add_metric([str(rank)], memory[column])
        yield gauge


def _decode_step_counters(timing):
    """Batch decode steps and their time by part (engine/step_timing.py): rate() of the parts over
    rate() of the steps is the split /stats.batch.decode_timing gives since start."""
    yield CounterMetricFamily(PREFIX + "decode_steps", "batch decode steps", value=timing.steps)
    seconds = CounterMetricFamily(PREFIX + "decode_step_seconds", "batch decode step time by part",
                                  labels=["part"])
    for part, value in (("build", timing.build_s), ("submit", timing.submit_s),
                        ("device_wait", timing.device_wait_s), ("output", timing.output_s)):
        seconds.add_metric([part], value)
    yield seconds


class ServerMetrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by reason",
                                       ["finished_reason"], registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in prompt caches",
                                      registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens served from prompt caches",
                                   registry=r)

        def latency(name, doc):
            return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency("time_to_first_token_seconds", "Submit to first token")
        self.itl = latency("inter_token_latency_seconds", "Gap between successive tokens")
        self.e2e = latency("e2e_request_latency_seconds", "Submit to last token")
        self.queue = latency("request_queue_time_seconds", "Submit to engine pickup")
        self.prefill = latency("request_prefill_time_seconds", "Engine pickup to first token")
        self.decode = latency("request_decode_time_seconds", "First token to last token")
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens", "Prompt length", buckets=TOKEN_BUCKETS,
                                    registry=r)
        self.generation_len = Histogram(PREFIX + "request_generation_tokens", "Generated tokens",
                                        buckets=TOKEN_BUCKETS, registry=r)
        r.register(_EngineGauges(state))

    def observe(self, done: RequestDone) -> None:
        self.request_success.labels(done.finish_reason.value).inc()
        usage = done.usage
        if usage is None:
            return
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.prefix_queries.inc(usage.prompt_tokens)
        self.prefix_hits.inc(usage.cached_tokens)
        self.prompt_len.observe(usage.prompt_tokens)
        self.generation_len.observe(usage.completion_tokens)
        self.queue.observe(usage.queue_s)
        if usage.ttft_s:
            self.ttft.observe(usage.ttft_s)
            self.prefill.observe(usage.prefill_s)
            self.decode.observe(usage.decode_s)
            self.e2e.observe(usage.ttft_s + usage.decode_s)
        for gap in usage.inter_token_s:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
