"""Engine metrics of the generation servers, for MLflow at each training step (SkyRL logs these by default).

Each scrape reads every replica's Prometheus endpoint (``GET /metrics``, vLLM's; our servers want the run's token
there, :func:`grpo_steps.servers.auth.auth_headers`) and, where the pipeline runs the router, the router's request
counts (:func:`grpo_steps.servers.router.requests_per_replica`), and returns a flat dict of floats:

- ``engine/requests_running``: requests in the engines' batches now (``vllm:num_requests_running``), summed;
- ``engine/requests_waiting``: requests queued now (``vllm:num_requests_waiting``), summed;
- ``engine/kv_cache_usage``: KV-cache blocks in use, a fraction 0..1 (``vllm:kv_cache_usage_perc``), averaged;
- ``engine/prefix_cache_hit_rate``: prompt tokens found in the prefix cache / prompt tokens looked up, 0..1, since
  the previous scrape (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``); absent when none was looked up;
- ``engine/preemptions``: requests preempted since the previous scrape (``vllm:num_preemptions``), summed;
- ``engine/generation_tokens_per_s``: tokens generated since the previous scrape (``vllm:generation_tokens``) / wall
  seconds between the two scrapes, summed: the mean rate over a training step (generation and training time
  alike), not the engine's peak;
- ``engine/replicas_scraped``: replicas that answered this scrape;
- ``engine/replica{i}/<name>``: each of the above but ``replicas_scraped``, for replica ``i`` (0-based, in
  ``TrainJob.replicas`` order), only with several replicas; a replica's hit rate is its own hits / queries;
- ``router/replica{i}/requests``: requests the router sent to replica ``i`` since the previous scrape (a delta, not
  the router's running total), only where the router's metrics URL is known.

Deltas are against the previous scrape that reached the same replica; the first scrape of a replica gives its gauges
only (call :meth:`EngineMetrics.scrape` once before the first step). A counter lower than before (the replica
restarted) counts from zero, as Prometheus's ``rate()`` does. A replica that does not answer is left out of that
scrape (and out of the sums) with one warning on stderr per replica: metrics never fail training.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from grpo_steps.servers.auth import auth_headers
from grpo_steps.servers.client import server_session
from grpo_steps.servers.router import requests_per_replica

GAUGES = {"vllm:num_requests_running": "requests_running", "vllm:num_requests_waiting": "requests_waiting",
          "vllm:kv_cache_usage_perc": "kv_cache_usage"}
"""vLLM 0.32's gauge samples (``vllm/v1/metrics/loggers.py``) -> our names."""
COUNTERS = {"vllm:prefix_cache_queries_total": "prefix_cache_queries", "vllm:prefix_cache_hits_total":
            "prefix_cache_hits", "vllm:num_preemptions_total": "preemptions",
            "vllm:generation_tokens_total": "generation_tokens"}
"""vLLM 0.32's counter samples (Prometheus text: the counter's name plus ``_total``) -> our names."""
SAMPLE_STARTS = tuple(f"{name}{end}" for name in {**GAUGES, **COUNTERS} for end in ("{", " "))
"""How the lines of those samples start: a server's text holds ~50 kB of others (histograms), parsed for nothing."""
MEAN_GAUGES = frozenset({"kv_cache_usage"})
"""Gauges averaged over engines and replicas (a fraction of each one's cache); the others are summed."""


@dataclass(frozen=True)
class EngineSample:
    """One replica's scrape: ``values`` (our names of :data:`GAUGES` and :data:`COUNTERS`, summed over the server's
    engines; a fraction averaged) at ``time_s`` (``time.monotonic()``, seconds)."""

    values: dict[str, float]
    time_s: float


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The gauges and counters of one vLLM server's ``/metrics`` text (Prometheus exposition format), by our names.

    A server with several engines (data parallel) has one sample per engine: counts are summed, fractions averaged.
    Metrics the server does not export are absent.

    >>> parse_engine_metrics('vllm:num_requests_running{engine="0"} 2.0\\n'
    ...                      'vllm:kv_cache_usage_perc{engine="0"} 0.25\\nvllm:kv_cache_usage_perc{engine="1"} 0.75\\n')
    {'requests_running': 2.0, 'kv_cache_usage': 0.5}
    """
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {}
    lines = "".join(line for line in text.splitlines(keepends=True) if line.startswith(SAMPLE_STARTS))
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            name = GAUGES.get(sample.name) or COUNTERS.get(sample.name)
            if name:
                found.setdefault(name, []).append(sample.value)
    return {name: sum(v) / len(v) if name in MEAN_GAUGES else sum(v) for name, v in found.items()}


def increase(now: float, before: float) -> float:
    """A counter's increase between two reads; a lower reading means it restarted from 0 (Prometheus ``rate()``).

    >>> increase(15.0, 10.0), increase(3.0, 10.0)
    (5.0, 3.0)
    """
    return now - before if now >= before else now


def step_values(now: EngineSample, before: EngineSample | None) -> dict[str, float]:
    """One replica's values for a step: the gauges, and with a previous sample the counters' increases
    (``preemptions``; ``generation_tokens_per_s`` over the wall seconds between the samples; ``prefix_cache_hit_rate``
    where prompt tokens were looked up) plus the raw increases ``prefix_cache_hits``/``queries`` (for the sum)."""
    values = {name: now.values[name] for name in GAUGES.values() if name in now.values}
    if before is None:
        return values
    delta = {name: increase(now.values[name], before.values.get(name, 0.0))
             for name in COUNTERS.values() if name in now.values}
    seconds = now.time_s - before.time_s
    if "generation_tokens" in delta and seconds > 0:
        values["generation_tokens_per_s"] = delta["generation_tokens"] / seconds
    if "preemptions" in delta:
        values["preemptions"] = delta["preemptions"]
    if "prefix_cache_queries" in delta and "prefix_cache_hits" in delta:
        hits, queries = delta["prefix_cache_hits"], delta["prefix_cache_queries"]
        values.update(prefix_cache_hits=hits, prefix_cache_queries=queries)  # kept for the replicas' sum
        if queries:  # no prompt looked up since the previous scrape: no rate
            values["prefix_cache_hit_rate"] = hits / queries
    return values


def combined(per_replica: list[dict[str, float]]) -> dict[str, float]:
    """The replicas' step values as one: counts and rates summed, cache usage averaged, the hit rate of the summed
    hits and queries (absent without queries).

    >>> total = combined([{"kv_cache_usage": 0.25, "preemptions": 1.0, "prefix_cache_hits": 1.0,
    ...                    "prefix_cache_queries": 4.0}, {"kv_cache_usage": 0.75, "prefix_cache_hits": 3.0,
    ...                    "prefix_cache_queries": 4.0}])
    >>> total["kv_cache_usage"], total["preemptions"], total["prefix_cache_hit_rate"]
    (0.5, 1.0, 0.5)
    """
    names = dict.fromkeys(name for values in per_replica for name in values if name != "prefix_cache_hit_rate")
    total = {}
    for name in names:
        present = [values[name] for values in per_replica if name in values]
        total[name] = sum(present) / len(present) if name in MEAN_GAUGES else sum(present)
    if total.get("prefix_cache_queries"):
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / total["prefix_cache_queries"]
    return total


def _logged(values: dict[str, float]) -> dict[str, float]:
    # the raw hit and query counts only make the rate; the rate is what is logged
    return {k: v for k, v in values.items() if k not in ("prefix_cache_hits", "prefix_cache_queries")}


class EngineMetrics:
    """Scrapes the generation replicas at ``endpoints`` (base URLs; one for a single server) and the router's
    Prometheus ``router_metrics`` URL (None: no router keys); :meth:`scrape` gives the module's keys.

    Args:
        endpoints: the servers' base URLs, e.g. ``http://127.0.0.1:8000``, in replica order.
        router_metrics: the router's ``/metrics`` URL (``TrainJob.router_metrics``) or None.
        timeout_s: per request, seconds; a replica slower than that is skipped for the scrape.
        clock: seconds, monotonic (tests may pass their own).
    """

    def __init__(self, endpoints: Sequence[str], router_metrics: str | None = None, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise ValueError("EngineMetrics needs at least one generation server endpoint")
        self.endpoints, self.router_metrics = tuple(e.rstrip("/") for e in endpoints), router_metrics
        self.timeout_s, self.clock = timeout_s, clock
        self._previous: dict[int, EngineSample] = {}  # replica index -> its last sample that answered
        self._router_previous: dict[str, float] | None = None  # the router's totals at the previous scrape
        self._warned: set[str] = set()  # endpoints already warned about
        self._http = server_session()

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            print(f"[engine-metrics] warning: {message}; metrics of the others go on, training is not affected "
                  "(warned once)", file=sys.stderr, flush=True)

    def _sample(self, index: int) -> EngineSample | None:
        endpoint = self.endpoints[index]
        try:
            # the replicas' session: a loopback listener is checked to be this user's before the token goes to it
            response = self._http.get(f"{endpoint}/metrics", headers=auth_headers(endpoint), timeout=self.timeout_s)
            response.raise_for_status()
            return EngineSample(parse_engine_metrics(response.text), self.clock())
        except (requests.RequestException, ValueError) as err:  # ValueError: text the Prometheus parser rejects
            self._warn_once(endpoint, f"generation replica {endpoint} gave no /metrics ({type(err).__name__}: "
                                      f"{str(err)[:200]}): left out of engine/* while it does not answer")
            return None

    def _router_values(self) -> dict[str, float]:
        totals = {url.rstrip("/"): count for url, count in
                  requests_per_replica(self.router_metrics, self.timeout_s).items()}
        previous = self._router_previous
        if previous is None:
            self._router_previous = totals  # the first scrape: the base of the deltas
            return {}
        if not totals:  # kept as the base: a router back after a failed scrape counts from its last totals
            self._warn_once(self.router_metrics, f"the router's metrics {self.router_metrics} gave no request counts "
                                                 "(it does not answer, or served no request yet)")
            return {}
        self._router_previous = totals
        # the router labels each replica by the URL the pipeline gave it (--worker-urls): absent means none yet
        return {f"router/replica{i}/requests": increase(totals.get(url, 0.0), previous.get(url, 0.0))
                for i, url in enumerate(self.endpoints)}

    def scrape(self) -> dict[str, float]:
        """The engine (and router) metrics now, by the keys of the module's table (floats); {} when no replica
        answers. Never raises for a replica or router that does not answer (a warning once each, on stderr)."""
        with ThreadPoolExecutor(min(len(self.endpoints), 16), thread_name_prefix="metrics") as pool:
            samples = list(pool.map(self._sample, range(len(self.endpoints))))
        per_replica: dict[int, dict[str, float]] = {}
        for i, sample in enumerate(samples):
            if sample is not None:
                per_replica[i] = step_values(sample, self._previous.get(i))
                self._previous[i] = sample
        metrics = {f"engine/{k}": v for k, v in _logged(combined(list(per_replica.values()))).items()}
        if per_replica:
            metrics["engine/replicas_scraped"] = float(len(per_replica))
        if len(self.endpoints) > 1:
            for i, values in per_replica.items():
                metrics.update({f"engine/replica{i}/{k}": v for k, v in _logged(values).items()})
        if self.router_metrics:
            metrics.update(self._router_values())
        return metrics
