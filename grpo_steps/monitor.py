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
    (``resume_logging``). A tracking outage pauses the samples; they go on once the server answers again.

    The environment's ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` overrides ``interval_s`` (MLflow's own rule)."""
    monitor = _outage_tolerant_monitor()(run_id, sampling_interval=interval_s, samples_before_logging=1,
                                         resume_logging=True, node_id=node_id, tracking_uri=tracking_uri)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def _outage_tolerant_monitor():
    """MLflow's ``SystemMetricsMonitor`` whose sampling thread outlives a tracking outage: MLflow's loop returns for
    good at the first failed ``get_run`` (mlflow 3's ``monitor``), so one outage in ``train`` ended the step's system
    metrics, and a short ``evaluate`` logged none at all (CI, 2026-12-06). Here the loop starts again after one
    interval until ``finish`` (a run no longer RUNNING is asked again each interval and gets nothing)."""
    import threading

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class OutageTolerantMonitor(SystemMetricsMonitor):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.finished = threading.Event()

        def monitor(self) -> None:
            while not self.finished.is_set():
                super().monitor()
                self.finished.wait(self.sampling_interval)

        def finish(self) -> None:
            self.finished.set()
            super().finish()

    return OutageTolerantMonitor


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
