"""Where a `make run`'s time goes: per flow step, and per training step, from the run's own records.

    .venv/bin/python bench/make_run_profile.py [RUN_ID] [--log FILE]   # default: the newest GRPOFlow run here

``--log``: read the ``[train]`` lines from this file (what ``make run`` printed) instead of the train task's log,
which Metaflow keeps only once the task has finished.

Reads the Metaflow run (each task's start and finish, the train task's log) and its MLflow run (the trainer's
metrics) and prints two Markdown tables (docs/benchmarks.md, "Where a make run's time
goes"):

- per flow step: wall seconds from the task's creation to its finish;
- per training step: the wall time between two ``[train]`` lines of the training log (everything the training
  process did in between: rollouts, rewards, forward/backward, optimizer, callbacks, checkpoint saves, held-out
  evaluations), TRL's ``step_time`` (generation + rewards + forward/backward, not the
  optimizer step nor the callbacks), ``generation/wait_seconds`` (the rollout request), ``weight_sync/seconds``
  (the push, inside ``step_time``), the held-out evaluation made at the step's beginning (``eval_during/seconds``),
  a checkpoint save (``checkpoint/save_seconds``), what is left (``other``: optimizer step, logging, callbacks) and
  the completions' mean and longest length (tokens: TRL pads the batch to the longest, which sets the step's
  compute).

The wall times come from the training log's ``[train]`` lines (``t`` since the training process started); step 1's
counts from ``[train] started`` (imports and model load done) where the log has that line. The push made for the
evaluation at a step's beginning is in that step's ``push`` and ``other``, not in TRL's ``step_time``.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

COLUMNS = {  # MLflow metric -> column
    "step_time": "TRL step_time",
    "generation/wait_seconds": "generation",
    "weight_sync/seconds": "push",
    "eval_during/seconds": "eval at step begin",
    "checkpoint/save_seconds": "checkpoint save",
    "completions/mean_length": "mean tokens",
    "completions/max_length": "longest",
}


def _seconds(delta) -> float:
    return delta.total_seconds()


def phase_table(run) -> list[tuple[str, float]]:
    """(step name, wall seconds) for each step of the Metaflow ``run``, in flow order (a gang: its slowest task)."""
    rows = []
    for step in reversed(list(run)):  # the client lists the newest first
        tasks = list(step)
        ends = [t.finished_at for t in tasks if t.finished_at is not None]
        if ends:  # an unfinished run: its finished steps
            rows.append((step.id, _seconds(max(ends) - min(t.created_at for t in tasks))))
    return rows


TRAIN_LINE = re.compile(r"\[train\] (?:step (\d+)/\d+|started at step (\d+)/\d+) t=([0-9.]+)s")


def step_table(client, mlflow_run_id: str, train_log: str) -> list[dict[str, float]]:
    """Per optimizer step: ``wall`` (seconds between two ``[train]`` lines of the training log: ``started`` or the
    previous step's end, to this step's end; step 1 of a log without a ``started`` line counts from the process's
    start) and the columns of ``COLUMNS`` (NaN where the run holds no point)."""
    ends, previous = {}, 0.0
    for step, started_at, t in TRAIN_LINE.findall(train_log):
        if started_at:
            previous = float(t)
        else:
            ends[int(step)] = float(t)
    history = {key: {int(m.step): m.value for m in client.get_metric_history(mlflow_run_id, key)} for key in COLUMNS}
    rows = []
    for step in sorted(ends):
        row = {"step": step, "wall": ends[step] - ends.get(step - 1, previous)}
        for key in COLUMNS:
            row[key] = history[key].get(step, float("nan"))
        # the held-out evaluation at the beginning of step N is logged at step N - 1 (the weights it measured)
        row["eval_during/seconds"] = history["eval_during/seconds"].get(step - 1, 0.0)
        row["checkpoint/save_seconds"] = history["checkpoint/save_seconds"].get(step, 0.0)
        row["other"] = row["wall"] - row["step_time"] - row["eval_during/seconds"] - row["checkpoint/save_seconds"]
        rows.append(row)
    return rows


def markdown(run, phases, steps) -> str:
    out = [f"`{run.pathspec}`, {run.created_at:%Y-%m-%d %H:%M} UTC\n", "| flow step | seconds |", "|---|---|"]
    out += [f"| {name} | {seconds:.0f} |" for name, seconds in phases]
    total = f"{_seconds(run.finished_at - run.created_at):.0f}" if run.finished_at else "unfinished"
    out.append(f"| **total** | **{total}** |\n")
    head = ["step", "wall", *COLUMNS.values(), "other"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in steps:
        cells = [f"{row['step']}", f"{row['wall']:.1f}", *(f"{row[k]:.1f}" for k in COLUMNS), f"{row['other']:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    total = {k: sum(r[k] for r in steps if r[k] == r[k]) for k in ("wall", *COLUMNS, "other")}
    out.append("| sum | " + " | ".join("" if k.startswith("completions/") else f"{total[k]:.0f}"
                                       for k in ("wall", *COLUMNS)) + f" | {total['other']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_id", nargs="?", help="Metaflow run id of GRPOFlow (default: the newest)")
    parser.add_argument("--log", type=Path, help="the output of make run (default: the train task's log)")
    args = parser.parse_args(argv)
    args.log = args.log.resolve() if args.log else None
    root = Path(__file__).resolve().parent.parent
    os.chdir(root)  # the local Metaflow datastore and mlflow.db live here
    os.environ.setdefault("METAFLOW_USER", "grpo")
    from metaflow import Flow, Run, namespace
    from mlflow import MlflowClient

    namespace(None)
    run = Run(f"GRPOFlow/{args.run_id}") if args.run_id else Flow("GRPOFlow").latest_run
    mlflow_run_id = run["start"].task.data.mlflow_run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    train_log = args.log.read_text() if args.log else "\n".join(task.stdout for task in run["train"])
    print(markdown(run, phase_table(run), step_table(client, mlflow_run_id, train_log)))


if __name__ == "__main__":
    main()
