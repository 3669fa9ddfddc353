"""Training checkpoints in the Metaflow datastore (metaflow-checkpoint), and metrics aligned with them.

The trainer writes a full checkpoint (weights, optimizer, scheduler, RNG, trainer state) to
``output_dir/checkpoint-N`` every ``save_steps``; :class:`DatastoreCheckpointCallback` then saves
that directory to the datastore of the running task (local or S3) under :func:`checkpoint_name` of
its node with ``{"global_step": N, "node_index": i}`` metadata. The nodes of a ``@parallel`` gang
share one checkpoint scope, so each node needs its own name: under one name their saves of the same
step get the same key and overwrite each other. :func:`resume_checkpoint` finds the one to continue
from: on ``@retry`` this task's newest for the node, on ``resume`` the origin run's.

:class:`MLflowMetricsCallback` logs each step once: a run that continues from an older checkpoint
does not log again the steps an earlier attempt already logged.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from transformers import TrainerCallback

CHECKPOINT_NAME = "grpo"


def checkpoint_name(node_index: int) -> str:
    """Datastore name of the checkpoints of node ``node_index`` (``grpo-node0``, ``grpo-node1``, ...)."""
    return f"{CHECKPOINT_NAME}-node{node_index}"


def in_metaflow_task() -> bool:
    """True inside a Metaflow task process with ``@checkpoint`` (or a child that inherited its env)."""
    return "METAFLOW_CHECKPOINT_UID" in os.environ


def mark_latest_zero_tag(path: Path, global_step: int) -> None:
    """Write DeepSpeed's ``latest`` tag file into the checkpoint ``path`` when it holds ZeRO partitions
    (``global_stepN/``) without one. DeepSpeed writes ``latest`` on global rank 0 only, so the other
    nodes' checkpoints could not be resumed from their own storage (``deepspeed_load_checkpoint`` reads
    the tag from it)."""
    tag = f"global_step{global_step}"
    if (path / tag).is_dir() and not (path / "latest").exists():
        (path / "latest").write_text(tag)


class DatastoreCheckpointCallback(TrainerCallback):
    """After each trainer save (rank 0 of each node), copy the new ``checkpoint-N`` to the datastore,
    then delete this node's older datastore checkpoints beyond the newest ``keep``.

    Args:
        node_index: the node of the gang (checkpoints are saved and found per node).
        keep: checkpoints of this node kept in the running task (all attempts), newest by global step.
        log_metrics: ``fn(metrics, step)`` that receives ``checkpoint/save_seconds`` (wall seconds of
            the upload) and ``checkpoint/kept``; None to skip.
    """

    def __init__(self, node_index: int = 0, keep: int | None = None, log_metrics=None) -> None:
        self.node_index, self.keep, self.log_metrics = node_index, keep, log_metrics
        self.checkpointer = None  # one Checkpoint for the whole process: its version counter names each save

    def on_save(self, args, state, control, **kwargs):
        if not state.is_local_process_zero:
            return control
        from metaflow import Checkpoint

        if self.checkpointer is None:
            self.checkpointer = Checkpoint()
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        mark_latest_zero_tag(path, state.global_step)
        print(f"[checkpoint] saving step={state.global_step} node={self.node_index} pid={os.getpid()}", flush=True)
        start = time.perf_counter()
        self.checkpointer.save(path=str(path), name=checkpoint_name(self.node_index),
                               metadata={"global_step": state.global_step, "node_index": self.node_index})
        seconds = time.perf_counter() - start
        kept = self._prune() if self.keep else None
        print(f"[checkpoint] saved step={state.global_step} node={self.node_index} pid={os.getpid()} "
              f"seconds={seconds:.2f}", flush=True)
        if self.log_metrics:
            self.log_metrics({"checkpoint/save_seconds": seconds, **({"checkpoint/kept": kept} if kept else {})},
                             state.global_step)
        return control

    def _prune(self) -> int:
        """Delete this node's datastore checkpoints older than the newest ``keep``; returns how many remain.

        metaflow-checkpoint 0.2 has no public delete: this uses the write datastore of the task's
        ``Checkpoint`` (pinned ``<0.3`` in pyproject; covered by the flow tests).
        """
        from metaflow_extensions.obcheckpoint.plugins.machine_learning_utilities.datastructures import (
            CheckpointArtifact,
        )

        mine = self.checkpointer.list(name=checkpoint_name(self.node_index))
        mine.sort(key=lambda c: c["metadata"]["global_step"], reverse=True)
        datastore = self.checkpointer._checkpointer._checkpoint_datastore
        for old in mine[self.keep:]:
            datastore.delete(CheckpointArtifact.hydrate(old))
            print(f"[checkpoint] removed step={old['metadata']['global_step']} node={self.node_index} "
                  f"(train.save_total_limit={self.keep})", flush=True)
        return min(len(mine), self.keep)


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

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` unless an earlier attempt already logged that step."""
        from grpo_steps.tracking import log_metrics_with

        if step > self.logged_up_to:
            log_metrics_with(self.client, self.run_id, metrics, step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return control
        numeric = {k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.log({**numeric, self.WATERMARK: state.global_step}, state.global_step)
        return control


class ProgressCallback(TrainerCallback):
    """Prints ``[train] step N/M t=T s rate=R s/step eta=E s`` after each optimizer step (rank 0): ``t``
    since the training process started (the first step's is the time to first step of a fresh or resumed
    run), ``rate`` the mean seconds per step of the steps this process ran, ``eta`` the rest at that rate.
    """

    def __init__(self, started: float) -> None:
        self.started = started  # time.monotonic() at process start
        self.first: tuple[int, float] | None = None  # (global step, time) when this process's first step ended

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        now, step = time.monotonic(), state.global_step
        if self.first is None:
            self.first = (step, now)
            rate = (now - self.started) / max(step, 1) if step == 1 else None
        else:
            rate = (now - self.first[1]) / (step - self.first[0])
        timing = f" rate={rate:.1f}s/step eta={rate * (state.max_steps - step):.0f}s" if rate else ""
        print(f"[train] step {step}/{state.max_steps} t={now - self.started:.1f}s{timing}", flush=True)
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


class CheckpointNotFound(ValueError):
    """A checkpoint reference (``train.resume_from``) that names nothing usable; the message says why."""


def _newest_of_run(run, node_index: int) -> dict | None:
    """Newest checkpoint (by global step) saved by ``node_index`` in the ``train`` step of ``run``."""
    from metaflow import Checkpoint

    name = checkpoint_name(node_index)
    saved = {c["key"]: c for task in run["train"] for c in Checkpoint().list(task=task, name=name)}.values()
    return max(saved, key=lambda c: c["metadata"]["global_step"]) if saved else None


def _load(reference, what: str) -> str:
    """Load a datastore checkpoint into the task's checkpoint directory; the trainer checkpoint in it.

    Raises:
        CheckpointNotFound: the checkpoint holds no trainer state (``trainer_state.json``), so training
            would silently start over.
    """
    from metaflow import current

    print(f"[checkpoint] resuming from {what}", flush=True)
    current.checkpoint.load(reference)  # into current.checkpoint.directory
    found = trainer_checkpoint_in(current.checkpoint.directory)
    if not found:
        raise CheckpointNotFound(f"the checkpoint of {what} holds no trainer state (trainer_state.json)")
    return found


def _local_checkpoint(reference: str) -> str | None:
    """The trainer checkpoint in ``reference`` when it is a local directory; None when it is no directory.

    Raises:
        CheckpointNotFound: a directory without a trainer checkpoint.
    """
    local = Path(reference).expanduser()
    if not local.is_dir():
        return None
    found = trainer_checkpoint_in(local)
    if not found:
        raise CheckpointNotFound(f"train.resume_from {reference!r}: no trainer checkpoint (trainer_state.json) "
                                 "in that directory or its checkpoint-* subdirectories")
    return found


def resolve_reference(reference: str, node_index: int) -> str:
    """Trainer checkpoint directory for a ``train.resume_from`` reference, loaded from the datastore
    when it is a run pathspec or a checkpoint key. Call inside the ``train`` step.

    Raises:
        CheckpointNotFound: the directory holds no trainer checkpoint, the run does not exist or has
            no checkpoint of this node, or the key does not load.
    """
    from metaflow import Flow
    from metaflow.exception import MetaflowNotFound

    found = _local_checkpoint(reference)
    if found:
        print(f"[checkpoint] resuming from local directory {found}", flush=True)
        return found
    parts = reference.strip("/").split("/")
    if len(parts) == 2:  # Flow/run_id
        try:
            run = Flow(parts[0])[parts[1]]
        except MetaflowNotFound as err:
            raise CheckpointNotFound(f"train.resume_from {reference!r}: no such run in this datastore/namespace "
                                     f"({err}); give 'FlowName/run_id', a checkpoint key or a directory") from None
        newest = _newest_of_run(run, node_index)
        if newest is None:
            raise CheckpointNotFound(f"train.resume_from {reference!r}: that run saved no checkpoint for node "
                                     f"{node_index}")
        return _load(newest, f"step {newest['metadata']['global_step']} of run {reference}")
    try:
        return _load(reference, f"checkpoint key {reference}")
    except CheckpointNotFound as err:
        raise CheckpointNotFound(f"train.resume_from {reference!r}: {err}") from None
    except Exception as err:  # metaflow-checkpoint raises several types for a bad key
        raise CheckpointNotFound(f"train.resume_from {reference!r} is not a directory, a 'FlowName/run_id' "
                                 f"pathspec or a loadable checkpoint key: {err}") from err


def check_reference(reference: str, num_nodes: int = 1) -> str:
    """Check a ``train.resume_from`` reference without loading it (before any server starts); returns
    what it names, for the log.

    A directory must hold a trainer checkpoint; a ``FlowName/run_id`` pathspec must name a run of this
    datastore and namespace whose ``train`` step saved a checkpoint for each of the ``num_nodes`` nodes;
    anything else must be a checkpoint key whose metadata is in the datastore.

    Raises:
        CheckpointNotFound: the reference names none of these; the message names it and what to give.
    """
    from metaflow import Flow
    from metaflow.exception import MetaflowNotFound

    found = _local_checkpoint(reference)
    if found:
        return f"local directory {found}"
    parts = reference.strip("/").split("/")
    if len(parts) == 2 and not reference.startswith(("/", ".", "~")):
        try:
            run = Flow(parts[0])[parts[1]]
        except (MetaflowNotFound, KeyError) as err:  # no such flow / no such run
            raise CheckpointNotFound(f"train.resume_from {reference!r}: no such run in this datastore/namespace "
                                     f"({err}); give 'FlowName/run_id', a checkpoint key or a directory") from None
        if "train" not in run:
            raise CheckpointNotFound(f"train.resume_from {reference!r}: that run never reached its train step")
        steps = []
        for node in range(num_nodes):
            newest = _newest_of_run(run, node)
            if newest is None:
                raise CheckpointNotFound(f"train.resume_from {reference!r}: that run saved no checkpoint for node "
                                         f"{node}")
            steps.append(newest["metadata"]["global_step"])
        return f"run {reference}, step {steps[0]}" + (f" (nodes: {steps})" if num_nodes > 1 else "")
    from metaflow_extensions.obcheckpoint.plugins.machine_learning_utilities.datastructures import (
        CheckpointArtifact,
    )

    try:
        found = CheckpointArtifact._load_metadata_from_key(reference, None)
    except Exception as err:  # metaflow-checkpoint raises several types for a bad key
        raise CheckpointNotFound(f"train.resume_from {reference!r} is not a directory, a 'FlowName/run_id' "
                                 f"pathspec or a checkpoint key in this datastore ({type(err).__name__}: {err})"
                                 ) from None
    return f"checkpoint key {reference} ({found.name}, version {found.version_id})"


def resume_checkpoint(node_index: int, configured: str | None = None) -> str | None:
    """Trainer checkpoint directory the current ``train`` task continues from, or None (start fresh).

    In order: ``@retry``: this task's newest checkpoint of this node (earlier attempts);
    ``resume``: the newest checkpoint of the origin run's ``train`` step saved by the same node; else
    ``configured`` (``train.resume_from``, see :func:`resolve_reference`). Call inside the ``train``
    step of a flow.

    Raises:
        CheckpointNotFound: as :func:`resolve_reference`.
    """
    from metaflow import Flow, current

    if current.retry_count:
        saved = current.checkpoint.list(name=checkpoint_name(node_index))  # every attempt of this task
        if saved:
            newest = max(saved, key=lambda c: c["metadata"]["global_step"])
            return _load(newest, f"this task's step {newest['metadata']['global_step']} (retry)")
    if current.origin_run_id:
        newest = _newest_of_run(Flow(current.flow_name)[current.origin_run_id], node_index)
        if newest is not None:
            return _load(newest, f"step {newest['metadata']['global_step']} of run {current.origin_run_id}")
    return resolve_reference(configured, node_index) if configured else None
