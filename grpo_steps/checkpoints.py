"""Training checkpoints in the Metaflow datastore (metaflow-checkpoint), and metrics aligned with them.

The trainer writes a full checkpoint (weights, optimizer, scheduler, RNG, trainer state) to
``output_dir/checkpoint-N`` every ``save_steps``; :class:`DatastoreCheckpointCallback` then saves
that directory to the datastore of the running task (local or S3) under ``CHECKPOINT_NAME`` with
``{"global_step": N, "node_index": i}`` metadata. :func:`resume_checkpoint` finds the one to
continue from: on ``@retry`` the ``@checkpoint`` decorator has loaded this task's newest; on
``resume`` it loads the origin run's newest for the same node.

:class:`MLflowMetricsCallback` logs each step once: a run that continues from an older checkpoint
does not log again the steps an earlier attempt already logged.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback

CHECKPOINT_NAME = "grpo"


def in_metaflow_task() -> bool:
    """True inside a Metaflow task process with ``@checkpoint`` (or a child that inherited its env)."""
    return "METAFLOW_CHECKPOINT_UID" in os.environ


class DatastoreCheckpointCallback(TrainerCallback):
    """After each trainer save (rank 0 of each node), copy the new ``checkpoint-N`` to the datastore."""

    def __init__(self, node_index: int = 0) -> None:
        self.node_index = node_index
        self.checkpointer = None  # one Checkpoint for the whole process: its version counter names each save

    def on_save(self, args, state, control, **kwargs):
        if not state.is_local_process_zero:
            return control
        from metaflow import Checkpoint

        if self.checkpointer is None:
            self.checkpointer = Checkpoint()
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.checkpointer.save(path=str(path), name=CHECKPOINT_NAME,
                               metadata={"global_step": state.global_step, "node_index": self.node_index})
        print(f"[checkpoint] saved step={state.global_step} node={self.node_index} pid={os.getpid()}", flush=True)
        return control


class MLflowMetricsCallback(TrainerCallback):
    """Log the trainer's numeric logs to the MLflow run ``run_id`` at their global step (rank 0).

    Steps the run already holds (an earlier attempt logged them before it died) are not logged
    again, so a run resumed from an older checkpoint keeps one continuous history: every step once,
    none missing. The watermark is the newest step of the ``WATERMARK`` metric, read at train start.
    """

    WATERMARK = "trainer/global_step"

    def __init__(self, run_id: str, tracking_uri: str) -> None:
        from mlflow import MlflowClient

        self.run_id, self.client = run_id, MlflowClient(tracking_uri=tracking_uri)
        self.logged_up_to = 0

    def on_train_begin(self, args, state, control, **kwargs):
        history = self.client.get_metric_history(self.run_id, self.WATERMARK)
        self.logged_up_to = max((int(m.step) for m in history), default=0)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or state.global_step <= self.logged_up_to:
            return control
        from grpo_steps.tracking import log_metrics_with

        step = state.global_step
        numeric = {k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        log_metrics_with(self.client, self.run_id, {**numeric, self.WATERMARK: step}, step)
        return control


def trainer_checkpoint_in(directory: str | os.PathLike | None) -> str | None:
    """The trainer checkpoint held in a loaded checkpoint directory, or None when it holds none."""
    if not directory:
        return None
    directory = Path(directory)
    if (directory / "trainer_state.json").exists():
        return str(directory)
    candidates = sorted(directory.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return str(candidates[-1]) if candidates else None


def resume_checkpoint(node_index: int) -> str | None:
    """Trainer checkpoint directory the current ``train`` task continues from, or None (start fresh).

    ``@retry``: the checkpoint ``@checkpoint(load_policy="fresh")`` loaded. ``resume``: the newest
    checkpoint of the origin run's ``train`` step saved by the same node, loaded now. Call inside the
    ``train`` step of a flow.
    """
    from metaflow import Checkpoint, Flow, current

    if current.checkpoint.is_loaded:
        return trainer_checkpoint_in(current.checkpoint.directory)
    if not current.origin_run_id:
        return None
    origin = Flow(current.flow_name)[current.origin_run_id]
    saved = [c for task in origin[current.step_name] for c in Checkpoint().list(task=task, name=CHECKPOINT_NAME)
             if c["metadata"].get("node_index", 0) == node_index]
    if not saved:
        return None
    newest = max(saved, key=lambda c: c["metadata"]["global_step"])
    print(f"[checkpoint] resuming from step {newest['metadata']['global_step']} of run {current.origin_run_id}")
    current.checkpoint.load(newest)  # into current.checkpoint.directory
    return trainer_checkpoint_in(current.checkpoint.directory)
