"""The training process's ``TrainerCallback``s: datastore checkpoints, MLflow metrics, progress lines,
and the stop of a run whose rewards all score None. Imported by :mod:`grpo_steps.training.entry` only, so the
flow's own tasks never import transformers for them.

:class:`MLflowMetricsCallback` logs each step once: a run that continues from an older checkpoint
does not log again the steps an earlier attempt already logged.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from transformers import TrainerCallback

from grpo_steps import trl_hooks
from grpo_steps.checkpoints import checkpoint_bytes, checkpoint_name, mark_latest_zero_tag, steps_to_prune
from grpo_steps.tracking import with_glance
from grpo_steps.weights.files import require_space
from rewards import guard


class DatastoreCheckpointCallback(TrainerCallback):
    """After each trainer save (rank 0 of each node), copy the new ``checkpoint-N`` to the datastore,
    then delete this node's older datastore checkpoints beyond the newest ``keep``. Before each save, the output
    directory must have room for it (:func:`grpo_steps.checkpoints.checkpoint_bytes`), else ``NoSpaceError``: the
    attempt fails before writing, and ``@retry`` continues from the last checkpoint in the datastore (a save the
    disk cut short is never uploaded: the upload follows a complete save).

    Args:
        node_index: the node of the gang (checkpoints are saved and found per node).
        keep: checkpoints of this node kept in the running task (all attempts), newest by global step.
        log_metrics: ``fn(metrics, step)`` that receives ``checkpoint/save_seconds`` (wall seconds of
            the upload) and ``checkpoint/kept``; None to skip.
    """

    def __init__(self, node_index: int = 0, keep: int | None = None, log_metrics=None, num_nodes: int = 1) -> None:
        self.node_index, self.keep, self.log_metrics = node_index, keep, log_metrics
        self.num_nodes = num_nodes  # the gang's size: the step every node saved is never pruned
        self.checkpointer = None  # one Checkpoint for the whole process: its version counter names each save

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # the trainer saves right after this hook when should_save is set: refuse a save that cannot fit first
        if control.should_save and state.is_local_process_zero and model is not None:
            require_space(f"checkpoint-{state.global_step}", args.output_dir, checkpoint_bytes(args.output_dir, model),
                          f"train.save_total_limit (local copies kept: {args.save_total_limit}), or free space in "
                          "the train step's scratch (/dev/shm when it exists; resources.train.shared_memory_mib on "
                          "Kubernetes)")
        return control

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
        """Delete this node's datastore checkpoints older than the newest ``keep`` and older than the newest step
        every node of the gang saved (where a retried or resumed gang restarts,
        :func:`grpo_steps.checkpoints.steps_to_prune`); returns how many remain.

        metaflow-checkpoint 0.2 has no public delete: this uses the write datastore of the task's
        ``Checkpoint`` (pinned ``<0.3`` in pyproject; covered by the flow tests).
        """
        from metaflow_extensions.obcheckpoint.plugins.machine_learning_utilities.datastructures import (
            CheckpointArtifact,
        )

        saved = {node: {c["metadata"]["global_step"]: c for c in self.checkpointer.list(name=checkpoint_name(node))}
                 for node in range(self.num_nodes)}
        deletable = steps_to_prune({node: list(steps) for node, steps in saved.items()}, self.node_index, self.keep,
                                   self.num_nodes)
        datastore = self.checkpointer._checkpointer._checkpoint_datastore
        for step in deletable:
            datastore.delete(CheckpointArtifact.hydrate(saved[self.node_index][step]))
            print(f"[checkpoint] removed step={step} node={self.node_index} "
                  f"(train.save_total_limit={self.keep})", flush=True)
        return len(saved[self.node_index]) - len(deletable)


class MLflowMetricsCallback(TrainerCallback):
    """Log the trainer's numeric logs to the MLflow run ``run_id`` at their global step (rank 0).

    Steps the run already holds (an earlier attempt logged them before it died) are not logged
    again, so a run resumed from an older checkpoint keeps one continuous history: every step once,
    none missing. The watermark is the newest step of the ``WATERMARK`` metric, read at train start.
    Points go through a :class:`grpo_steps.tracking.TrackingQueue` (``queue``; the completions tables too): a
    tracking server that goes away mid-training delays them; at train end the queue is drained within
    ``outage_wait_s`` seconds (``tracking.outage_wait_s``).
    """

    WATERMARK = "trainer/global_step"

    def __init__(self, run_id: str, tracking_uri: str, outage_wait_s: float = 600.0) -> None:
        from mlflow import MlflowClient

        from grpo_steps.tracking import TrackingQueue

        self.run_id, self.client = run_id, MlflowClient(tracking_uri=tracking_uri)
        self.logged_up_to, self.outage_wait_s = 0, outage_wait_s
        self.queue = TrackingQueue(self.client, run_id)  # a tracking outage neither stalls nor fails training

    def on_train_begin(self, args, state, control, **kwargs):
        history = self.client.get_metric_history(self.run_id, self.WATERMARK)
        self.logged_up_to = max((int(m.step) for m in history), default=0)
        return control

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step`` for the run unless an earlier attempt already logged that step."""
        if step > self.logged_up_to:
            self.queue.log(metrics, step)

    SAVE_WAIT_S = 60.0
    """Seconds a checkpoint save waits at most for the queued points to reach a reachable tracking server."""

    def on_save(self, args, state, control, **kwargs):
        # before the checkpoint (the callback after this one saves it): an attempt that continues from step N trains
        # from N + 1, so step N's points must be in the run by then, or a kill right after the save leaves N out of
        # the history for good (the queue lives in this process). A tracking server that is failing is not waited
        # for: an outage neither stalls nor fails training (a kill in it loses the points still queued)
        if state.is_world_process_zero and not self.queue.settle(self.SAVE_WAIT_S):
            print(f"[mlflow] checkpoint step={state.global_step} saved with metric points still queued for the "
                  "tracking server", flush=True)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.queue.close(self.outage_wait_s)  # every step in the run, or TrackingBacklog after outage_wait_s
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return control
        numeric = {k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.log({**with_glance(numeric), self.WATERMARK: state.global_step}, state.global_step)
        return control


class EngineMetricsCallback(TrainerCallback):
    """Adds the generation servers' engine metrics (:class:`grpo_steps.servers.engine_metrics.EngineMetrics`:
    ``engine/...``, ``engine/replica{i}/...``, ``router/replica{i}/requests``) to the trainer's ``logs`` at each log,
    on global rank 0 only, so :class:`MLflowMetricsCallback` (after it in the trainer's callbacks) writes them at the
    same step as TRL's metrics. A first scrape at train begin is the base of the first step's deltas; a step logs them
    once (the trainer's closing summary log, at the last step again, gets none). A server that does not answer is left
    out (warned once) and never fails training.

    Args:
        scraper: an ``EngineMetrics`` (anything whose ``scrape()`` returns ``{name: float}``).
    """

    def __init__(self, scraper) -> None:
        self.scraper, self.scraped_step = scraper, None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.scraper.scrape()  # the base of the first step's deltas (tokens/s, preemptions, hit rate)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs is not None and state.global_step != self.scraped_step:
            self.scraped_step = state.global_step
            logs.update(self.scraper.scrape())  # the same dict the MLflow callback reads next
        return control


def engine_metrics(job) -> list[EngineMetricsCallback]:
    """``[EngineMetricsCallback]`` of the job's generation server (each replica, and the router where the pipeline
    started one: its ``metrics_endpoint``; and the distillation teacher's server, ``teacher/engine/...``) with
    ``tracking.engine_metrics``, a tracked run (``job.mlflow_run_id``) and rollouts from a server (backend ``vllm``,
    mode ``server``); ``[]`` otherwise. To be placed before :class:`MLflowMetricsCallback` (the callbacks' order)."""
    cfg, server = job.config, job.generation_server()
    if not (cfg.tracking.engine_metrics and job.mlflow_run_id and cfg.generation.backend == "vllm"
            and cfg.generation.mode == "server" and server is not None):
        return []
    from grpo_steps.servers.engine_metrics import EngineMetrics

    client = server.client()
    callbacks = [EngineMetricsCallback(EngineMetrics(list(client.replicas) or [server.endpoint],
                                                     server.metrics_endpoint))]
    from grpo_steps.servers import teacher as teacher_server

    teacher = teacher_server.of(job.server)
    if teacher is not None:  # teacher: the distillation teacher's server, logged as teacher/engine/...
        callbacks.append(TeacherEngineMetricsCallback(EngineMetrics([teacher.endpoint])))
    return callbacks


class TeacherEngineMetricsCallback(EngineMetricsCallback):
    """:class:`EngineMetricsCallback` of the distillation teacher's server, its metrics named ``teacher/engine/...``
    (a class of its own: transformers keeps one callback per class quietly)."""

    def __init__(self, scraper) -> None:
        super().__init__(self)
        self.engine = scraper

    def scrape(self) -> dict[str, float]:
        return {f"teacher/{name}": value for name, value in self.engine.scrape().items()}


COMPLETIONS_DIR = "completions"
"""Artifact folder of the per-step completions tables: ``completions/step_000010.json``."""


def completions_table(trainer, version: int) -> dict[str, list]:
    """The latest generation batch as a table (column -> values): ``prompt`` (the last message of a conversational
    prompt), ``completion`` (its text; a multi-turn one whole: tool calls and answers), one column per reward
    function (None where it did not apply), ``advantage`` and ``weight_version`` (the policy version that sampled it).
    Read from TRL's log of the batch (:func:`grpo_steps.trl_hooks.logged_batch`: gathered from every
    process; main process only)."""
    import math

    logs = trl_hooks.logged_batch(trainer)

    from grpo_steps.evaluation.episodes import conversation

    def text(value, whole: bool) -> str:
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            # a multi-turn completion is shown whole (tool calls and answers), a prompt by its question
            return conversation(value) if whole and len(value) > 1 else str(value[-1].get("content", ""))
        return str(value)

    table: dict[str, list] = {"prompt": [text(p, False) for p in logs["prompt"]],
                              "completion": [text(c, True) for c in logs["completion"]]}
    for name, values in logs["rewards"].items():
        table[name] = [None if v is None or math.isnan(v) else float(v) for v in values]
    table["advantage"] = [float(a) for a in logs["advantages"]]
    table["weight_version"] = [version] * len(table["prompt"])
    return table


class CompletionsTableCallback(TrainerCallback):
    """Every ``every`` optimizer steps (``train.log_completions_steps``), queues the latest generation batch
    (:func:`completions_table`) for the MLflow run as ``completions/step_NNNNNN.json`` on ``queue`` (the metrics'
    :class:`grpo_steps.tracking.TrackingQueue`: a tracking outage delays the table, never the step), so the MLflow UI
    shows what the policy wrote at that step (main process). Each step's table is logged once: MLflow appends to an
    existing table file, so a step queued already (the last step is logged twice) is skipped here, and one the run
    holds (an earlier attempt of a resumed run) by the queue."""

    def __init__(self, trainer, queue, every: int) -> None:
        self.trainer, self.queue, self.every = trainer, queue, every
        self.queued: set[str] = set()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or state.global_step % self.every \
                or not trl_hooks.logged_batch(self.trainer)["prompt"]:
            return control
        path = f"{COMPLETIONS_DIR}/step_{state.global_step:06d}.json"
        if path not in self.queued:
            table = completions_table(self.trainer, getattr(self.trainer, "sampled_version", state.global_step - 1))
            self.queue.log_table(table, path)  # text cells redacted
            self.queued.add(path)
        return control


class ProgressCallback(TrainerCallback):
    """Prints ``[train] started at step N/M t=T s`` when training begins and ``[train] step N/M t=T s rate=R s/step
    eta=E s`` after each optimizer step (rank 0): ``t``
    since the training process started (the first step's is the time to first step of a fresh or resumed
    run), ``rate`` the mean seconds per step of the steps this process ran, ``eta`` the rest at that rate.
    """

    def __init__(self, started: float) -> None:
        self.started = started  # time.monotonic() at process start
        self.first: tuple[int, float] | None = None  # (global step, time) when this process's first step ended

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # the first step's line comes after a push and maybe an evaluation
            print(f"[train] started at step {state.global_step}/{state.max_steps} "
                  f"t={time.monotonic() - self.started:.1f}s (imports, model and data loaded)", flush=True)
        return control

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
        # the rewards that ran this step (the counts are the process's: another job's rewards have no new calls)
        delta = {name: (n - self.seen.get(name, (0, 0))[0], nones - self.seen.get(name, (0, 0))[1])
                 for name, (n, nones) in now.items() if n > self.seen.get(name, (0, 0))[0]}
        self.seen = now
        if not delta:
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
