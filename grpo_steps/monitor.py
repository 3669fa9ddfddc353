"""Watching a run while it goes: a training callback that stops a run whose rewards all score None,
MLflow system metrics (CPU, memory, GPU) around a step's work, and progress lines with rate and ETA."""

from __future__ import annotations

import time
from contextlib import contextmanager

from transformers import TrainerCallback

from rewards import guard


class AllRewardsNone(RuntimeError):
    """Every reward scored None for every completion for ``train.max_all_none_steps`` steps in a row."""


class AllNoneStop(TrainerCallback):
    """Stop training (raise :class:`AllRewardsNone`) when, for ``limit`` optimizer steps in a row, every
    completion scored by the guarded rewards of this process got None from every reward: nothing to learn
    from, and a sign of a reward that does not apply to the data or fails every call. Steps in which no
    reward ran (TRL reuses a generation batch over several steps) neither count nor reset the streak.

    Args:
        limit: steps in a row (``train.max_all_none_steps``); 0 disables the check.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.streak, self.seen = limit, [], guard.scored()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.limit:
            return control
        now = guard.scored()
        delta = {name: (n - self.seen.get(name, (0, 0))[0], nones - self.seen.get(name, (0, 0))[1])
                 for name, (n, nones) in now.items()}
        self.seen = now
        if not any(n for n, _ in delta.values()):
            return control
        if all(n == nones for n, nones in delta.values()):
            self.streak.append(state.global_step)
        else:
            self.streak = []
        if len(self.streak) >= self.limit:
            counts = guard.counters()
            failures = {k: v for k, v in counts.items() if v and k.split("/")[1] in delta}
            raise AllRewardsNone(
                f"every reward ({', '.join(sorted(delta))}) scored None for every completion in steps "
                f"{self.streak[0]}..{self.streak[-1]} ({len(self.streak)} in a row, train.max_all_none_steps="
                f"{self.limit}); failures so far: {failures or 'none: the rewards returned None'}. Check that the "
                "rewards apply to this data (the columns they need) and that they do not fail (rewards/<name>/errors, "
                "timeouts), or raise train.max_all_none_steps (0: never stop)"
            )
        return control


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
