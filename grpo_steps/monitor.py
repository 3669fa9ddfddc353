"""Watching a run while it goes: MLflow system metrics (CPU, memory, GPU) around a step's work, and
progress lines with rate and ETA. Imports neither torch nor transformers (the flow's tasks use it)."""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def system_metrics(run_id: str, tracking_uri: str, interval_s: float = 5.0, node_id: str | None = None):
    """Log MLflow system metrics (``system/cpu_utilization_percentage``, ``system/system_memory_usage_megabytes``,
    GPU utilisation and memory where a GPU is present, ...) to ``run_id`` every ``interval_s`` seconds
    while the block runs, with MLflow's own monitor (psutil; pynvml for GPUs). Samples are of the whole
    machine (``node_id`` tells machines apart). Steps continue after earlier steps' samples
    (``resume_logging``)."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, samples_before_logging=1,
                                   resume_logging=True, node_id=node_id, tracking_uri=tracking_uri)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


class Progress:
    """``[label] done/total unit rate=R unit/s eta=E s`` lines for a loop over ``total`` items.

    >>> p = Progress("eval baseline", 4, "prompts", clock=iter([0.0, 2.0]).__next__)
    >>> line = p.update(2)
    [eval baseline] 2/4 prompts t=2.0s rate=1.00 prompts/s eta=2s
    """

    def __init__(self, label: str, total: int, unit: str, clock=time.monotonic) -> None:
        self.label, self.total, self.unit, self.clock = label, total, unit, clock
        self.started, self.done = clock(), 0

    def update(self, n: int) -> str:
        """Count ``n`` more items done; print and return the progress line."""
        self.done += n
        elapsed = self.clock() - self.started
        rate = self.done / elapsed if elapsed > 0 else float("inf")
        eta = (self.total - self.done) / rate if rate else float("inf")
        line = (f"[{self.label}] {self.done}/{self.total} {self.unit} t={elapsed:.1f}s "
                f"rate={rate:.2f} {self.unit}/s eta={eta:.0f}s")
        print(line, flush=True)
        return line
