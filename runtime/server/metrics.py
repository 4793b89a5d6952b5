"""Prometheus metrics (vLLM-style names under ``trtbuild:``), in a registry of the server's own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("trtbuild:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=registry)
        self.prompt_tokens = Counter("trtbuild:prompt_tokens", "Prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("trtbuild:generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("trtbuild:time_to_first_token_seconds", "Time to first token", registry=registry,
                              buckets=LATENCY_BUCKETS)
        self.inter_token = Histogram("trtbuild:inter_token_latency_seconds", "Time between tokens of a request",
                                     registry=registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("trtbuild:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             registry=registry, buckets=LATENCY_BUCKETS)
        self.waiting = Gauge("trtbuild:num_requests_waiting", "Requests queued for a KV slot", registry=registry)
        self.running = Gauge("trtbuild:num_requests_running", "Requests holding a KV slot", registry=registry)
        self.kv_usage = Gauge("trtbuild:kv_slot_usage_perc", "Share of KV slots in use", registry=registry)
        self.prefix_hit_rate = Gauge("trtbuild:prefix_cache_hit_rate", "Prompt blocks served from the prefix cache",
                                     registry=registry)
        self.medusa_acceptance = Gauge("trtbuild:spec_decode_draft_acceptance_rate",
                                       "Medusa guesses accepted per guess verified, mean over heads", registry=registry)
        self.medusa_tokens_per_step = Gauge("trtbuild:spec_decode_tokens_per_step",
                                            "Mean tokens per verification step (Medusa)", registry=registry)

        # Totals since start, read from the runtime at each scrape (a gauge: the runtime counts them).
        self.engine_steps = Gauge("trtbuild:engine_steps", "Engine steps run (a multi-step run's each count)",
                                  registry=registry)
        self.engine_seconds = Gauge("trtbuild:engine_busy_seconds", "Seconds spent inside engine steps",
                                    registry=registry)
        self.loop_seconds = Gauge("trtbuild:engine_loop_seconds",
                                  "Seconds spent in engine-core steps (engine, sampling, scheduling, text)",
                                  registry=registry)
        self.kv_blocks_used = Gauge("trtbuild:kv_blocks_used", "KV budget blocks held by rows and the prefix cache",
                                    registry=registry)
        self.kv_blocks_free = Gauge("trtbuild:kv_blocks_free", "KV budget blocks holding nothing", registry=registry)
        self.kv_cache_usage = Gauge("trtbuild:kv_cache_usage_perc", "Share of the KV budget's blocks in use",
                                    registry=registry)
        self.preemptions = Gauge("trtbuild:num_preemptions", "Requests preempted for KV blocks (recomputed later)",
                                 registry=registry)
        self.prefix_hit_blocks = Gauge("trtbuild:prefix_cache_hit_blocks", "Prompt blocks served from the prefix cache",
                                       registry=registry)
        self.compiles_pending = Gauge("trtbuild:constraint_compiles_pending",
                                      "Constraint compiles running or waiting for a compile thread", registry=registry)
        self.compiles_refused = Gauge("trtbuild:constraint_compiles_refused",
                                      "Requests refused (503) because the compile pool was full", registry=registry)

    def observe_engine(self, llm) -> None:
        """Gauges from the runtime's state, read when /metrics is scraped."""
        scheduler = llm.scheduler
        self.waiting.set(llm.queue_depth())
        self.running.set(scheduler.slots.num_active)
        self.kv_usage.set(scheduler.slots.num_active / scheduler.slots.capacity)
        stats = llm.stats
        self.engine_steps.set(stats.steps)
        self.engine_seconds.set(stats.engine_s)
        self.loop_seconds.set(stats.loop_s)
        self.compiles_pending.set(llm.compile_pool.pending)
        self.compiles_refused.set(llm.compile_pool.refused)
        kv = scheduler.kv
        self.kv_blocks_used.set(kv.num_used)
        self.kv_blocks_free.set(kv.num_free)
        self.kv_cache_usage.set(kv.num_used / kv.num_blocks)
        self.preemptions.set(kv.stats.preemptions)
        self.prefix_hit_blocks.set(kv.stats.hits)
        if kv.stats.hits + kv.stats.misses:
            self.prefix_hit_rate.set(kv.stats.hits / (kv.stats.hits + kv.stats.misses))
        if llm.speculation is not None:
            stats = llm.speculation.stats
            self.medusa_tokens_per_step.set(stats.mean_accepted_per_step)
            acceptance = stats.head_acceptance()
            if acceptance:
                self.medusa_acceptance.set(sum(acceptance) / len(acceptance))

    def aborted(self, count: int) -> None:
        """Requests whose client went away before they finished (their KV slots were freed)."""
        self.requests.labels(finished_reason="abort").inc(count)

    def finished(self, completion) -> None:
        self.requests.labels(finished_reason=completion.finish_reason).inc()
        self.prompt_tokens.inc(len(completion.prompt_token_ids) - completion.cached_tokens)
        self.generation_tokens.inc(len(completion.token_ids))
        self.ttft.observe(max(0.0, completion.ttft_s))
        self.e2e.observe(max(0.0, completion.finish_s - completion.arrival_s))
        if len(completion.token_ids) > 1:
            self.inter_token.observe((completion.finish_s - completion.first_token_s) / (len(completion.token_ids) - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
