"""Prometheus metrics of one server (own CollectorRegistry) and the periodic stats log line.

Names use the `treeflash:` prefix with vLLM's suffixes, so dashboards and `vllm bench serve`
style tools (which take counter deltas) read them unchanged. Everything here is fed from the
engine thread; prometheus-client objects are thread-safe, and the plain integer totals kept
for the log line are written by that one thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("treeflash.server")

MAX_SPEC_POSITIONS = 64  # bound on the {position} label's cardinality
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass
class Totals:
    """Monotonic plain counters (engine thread writes, the logger reads and takes deltas)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_SPEC_POSITIONS)

    def copy(self) -> Totals:
        return Totals(
            self.prompt_tokens,
            self.generation_tokens,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            list(self.spec_accepted_per_pos),
        )


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.totals = Totals()
        self.num_running = self.num_waiting = 0
        self.kv_usage = 0.0
        r, label = self.registry, {"model_name": model_name}

        def counter(name, doc, labels=()):
            return Counter(f"treeflash:{name}", doc, ["model_name", *labels], registry=r)

        def gauge(name, doc):
            return Gauge(f"treeflash:{name}", doc, ["model_name"], registry=r).labels(**label)

        def histogram(name, doc):
            return Histogram(
                f"treeflash:{name}", doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=r
            ).labels(**label)

        self._label = label
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Speculative steps (verify passes)"
        ).labels(**label)
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified (tree nodes, root excluded)"
        ).labels(**label)
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted"
        ).labels(**label)
        self._spec_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Steps whose draft at this depth (0-based) was accepted",
            ["position"],
        )
        self._spec_by_budget = counter(
            "spec_decode_num_drafts_by_budget", "Speculative steps by the tree's node budget", ["budget"]
        )
        self.spec_plain = counter(
            "spec_decode_num_plain_steps",
            "Steps of speculative requests decoded without a tree (no tree paid: tree_budget auto)",
        ).labels(**label)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two engine outputs of a request"
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to finish")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests queued for admission")
        self.kv_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV pages in use (0..1)")
        self.kv_free_pages = gauge("kv_cache_free_pages", "KV pages free in the pool")
        self.kv_total_pages = gauge("kv_cache_total_pages", "KV pages in the pool")
        self.preemptions = counter(
            "num_preemptions", "Requests preempted (the engine never preempts yet)"
        ).labels(**label)
        self.aborts = counter(
            "num_aborted_requests", "Requests aborted (disconnect, shutdown, failure)"
        ).labels(**label)
        self.rejected = counter(
            "num_rejected_requests", "Requests refused before reaching the engine", ["reason"]
        )
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens").labels(**label)
        self.generation_tokens = counter("generation_tokens", "Generated tokens").labels(**label)

    # ---- engine-thread hooks -------------------------------------------------------
    def on_spec_step(self, request, num_drafted: int, num_accepted: int, budget: int | None = None) -> None:
        """An Engine.spec_listeners callback: one step of one speculative request, a verify of a
        tree of `budget` nodes, or (budget 0) a plain step."""
        if budget == 0:
            self.spec_plain.inc()
            return
        if budget is not None:
            self._spec_by_budget.labels(budget=str(budget), **self._label).inc()
        t = self.totals
        t.spec_drafts += 1
        t.spec_draft_tokens += num_drafted
        t.spec_accepted_tokens += num_accepted
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_drafted)
        self.spec_accepted.inc(num_accepted)
        # A walk from the root that accepted a drafts accepted depths 0..a-1.
        for pos in range(min(num_accepted, MAX_SPEC_POSITIONS)):
            t.spec_accepted_per_pos[pos] += 1
            self._spec_per_pos.labels(position=str(pos), **self._label).inc()

    def on_first_tokens(self, prompt_len: int, ttft: float) -> None:
        self.totals.prompt_tokens += prompt_len
        self.prompt_tokens.inc(prompt_len)
        self.ttft.observe(ttft)

    def on_tokens(self, n: int, itl: float | None) -> None:
        self.totals.generation_tokens += n
        self.generation_tokens.inc(n)
        if itl is not None:
            self.itl.observe(itl)

    def on_finish(self, reason: str | None, e2e: float) -> None:
        if reason == "abort":
            self.aborts.inc()
        else:
            self.success.labels(finished_reason=reason or "unknown", **self._label).inc()
        self.e2e.observe(e2e)

    def on_reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason, **self._label).inc()

    def set_state(self, running: int, waiting: int, free_pages: int, total_pages: int) -> None:
        self.num_running, self.num_waiting = running, waiting
        self.kv_usage = 1.0 - free_pages / total_pages if total_pages else 0.0
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_free_pages.set(free_pages)
        self.kv_total_pages.set(total_pages)
        self.kv_usage_perc.set(self.kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatLogger:
    """Logs throughput and speculation figures every interval in vLLM's wording."""

    def __init__(self, metrics: ServerMetrics, device_type: str = "cuda"):
        self.metrics = metrics
        # vLLM's wording where the cache is on a GPU; on the CPU it is not a "GPU KV cache"
        self.kv_label = "GPU KV cache" if device_type == "cuda" else "KV cache"
        self.last = metrics.totals.copy()
        self.last_time = time.monotonic()

    def log(self) -> list[str]:
        """Emit (and return) the lines for the interval since the previous call."""
        m, now, cur = self.metrics, time.monotonic(), self.metrics.totals.copy()
        dt, prev = max(now - self.last_time, 1e-9), self.last
        self.last, self.last_time = cur, now
        idle = (
            cur.prompt_tokens == prev.prompt_tokens
            and cur.generation_tokens == prev.generation_tokens
        )
        if idle and not (m.num_running or m.num_waiting):
            return []
        prompt_tps = (cur.prompt_tokens - prev.prompt_tokens) / dt
        gen_tps = (cur.generation_tokens - prev.generation_tokens) / dt
        lines = [
            f"Engine 000: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {m.num_running} reqs, Waiting: {m.num_waiting} reqs, "
            f"{self.kv_label} usage: {100 * m.kv_usage:.1f}%, Prefix cache hit rate: 0.0%"
        ]
        drafts = cur.spec_drafts - prev.spec_drafts
        if drafts:
            drafted = cur.spec_draft_tokens - prev.spec_draft_tokens
            accepted = cur.spec_accepted_tokens - prev.spec_accepted_tokens
            per_pos = [
                (c - p) / drafts
                for c, p in zip(cur.spec_accepted_per_pos, prev.spec_accepted_per_pos, strict=True)
            ]
            while per_pos and per_pos[-1] == 0:
                per_pos.pop()
            lines.append(
                f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / dt:.2f} tokens/s, "
                f"Drafted throughput: {drafted / dt:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%"
            )
        for line in lines:
            log.info(line)
        return lines
