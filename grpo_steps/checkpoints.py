"""Training checkpoints in the Metaflow datastore (metaflow-checkpoint), and metrics aligned with them.

The trainer writes a full checkpoint (weights, optimizer, scheduler, RNG, trainer state) to
``output_dir/checkpoint-N`` every ``save_steps``;
:class:`grpo_steps.training.callbacks.DatastoreCheckpointCallback` then saves that directory to the datastore
of the running task (local or S3) under :func:`checkpoint_name` of its node with
``{"global_step": N, "node_index": i}`` metadata. The nodes of a ``@parallel`` gang
share one checkpoint scope, so each node needs its own name: under one name their saves of the same
step get the same key and overwrite each other. :func:`resume_checkpoint` finds the one to continue
from: on ``@retry`` this task's newest for the node, on ``resume`` the origin run's.

This module imports neither torch nor transformers: the flow's tasks that only look checkpoints up
start fast. The training process's callbacks are in :mod:`grpo_steps.training.callbacks`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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


def trainer_checkpoint_in(directory: str | os.PathLike | None) -> str | None:
    """The trainer checkpoint held in a loaded checkpoint directory, or None when it holds none."""
    if not directory:
        return None
    directory = Path(directory)
    if (directory / "trainer_state.json").exists():
        return str(directory)
    candidates = sorted(directory.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return str(candidates[-1]) if candidates else None


def checkpoint_bytes(output_dir: str | os.PathLike, model) -> int:
    """Bytes the next trainer checkpoint in ``output_dir`` will take: the newest ``checkpoint-*`` there, measured;
    before the first, the weights plus AdamW's two float32 moments per trainable parameter (SmolLM2-135M in float32:
    513 MiB + 2 x 513 MiB, as measured in docs/benchmarks.md; a PEFT model's trainable parameters only). ``model``:
    the unwrapped policy (ZeRO-3 parameters count their full ``ds_numel``)."""
    newest = trainer_checkpoint_in(output_dir)
    if newest is not None:
        return sum(f.stat().st_size for f in Path(newest).rglob("*") if f.is_file())
    adapter_only = hasattr(model, "peft_config")  # a PEFT checkpoint holds the adapter, not the frozen base
    total = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", None) or p.numel()
        if p.requires_grad or not adapter_only:
            total += numel * p.element_size() + (2 * 4 * numel if p.requires_grad else 0)
    return total


class CheckpointNotFound(ValueError):
    """A checkpoint reference (``train.resume_from``) that names nothing usable; the message says why."""


def newest_common_step(saved: Mapping[int, Iterable[int]], num_nodes: int) -> int | None:
    """The newest global step that every node ``0..num_nodes-1`` of a gang saved (``saved``: node -> its saved
    steps), or None. A gang resumes there, every node together: a node's newer checkpoint without its partners'
    cannot be resumed (ZeRO-3 partitions, per-node trainer state), and nodes that restart from different steps
    train different weights.

    >>> newest_common_step({0: [2, 4, 6], 1: [2, 4]}, 2)  # killed between node 0's and node 1's save of step 6
    4
    >>> newest_common_step({0: [2], 1: []}, 2) is None, newest_common_step({0: [2, 4]}, 1)
    (True, 4)
    """
    steps = [set(saved.get(node, ())) for node in range(num_nodes)]
    common = set.intersection(*steps) if steps else set()
    return max(common) if common else None


def steps_to_prune(saved: Mapping[int, Iterable[int]], node_index: int, keep: int, num_nodes: int) -> list[int]:
    """The saved steps of node ``node_index`` that ``train.save_total_limit`` (``keep``) lets it delete: those older
    than its newest ``keep`` and older than :func:`newest_common_step` of the gang (that step is where every node
    resumes; a newer one may still become it, while a partner's save is under way). Until every node saved one step,
    nothing is deleted. Newest first.

    >>> steps_to_prune({0: [2, 4, 6], 1: [2, 4]}, 0, keep=1, num_nodes=2)  # node 1 has not saved 6 yet: keep 4
    [2]
    >>> steps_to_prune({0: [2, 4, 6], 1: [2, 4, 6]}, 0, keep=1, num_nodes=2)
    [4, 2]
    """
    common = newest_common_step(saved, num_nodes)
    mine = sorted(set(saved.get(node_index, ())), reverse=True)
    return [step for step in mine[keep:] if common is not None and step < common]


def _saved_by_node(list_node, num_nodes: int) -> dict[int, dict[int, dict]]:
    """``{node: {global step: checkpoint}}`` of nodes ``0..num_nodes-1``; ``list_node(name)`` lists a node's
    checkpoints by its :func:`checkpoint_name` (the nodes of a gang share one checkpoint scope, so each node sees the
    others' saves)."""
    return {node: {c["metadata"]["global_step"]: c for c in list_node(checkpoint_name(node))}
            for node in range(num_nodes)}


def _newest_common_checkpoint(saved: dict[int, dict[int, dict]], node_index: int, num_nodes: int) -> dict | None:
    """Node ``node_index``'s checkpoint at the gang's :func:`newest_common_step`, or None when there is none; says
    so when a node saved a newer step that the gang cannot use (it died before its partners saved theirs)."""
    step = newest_common_step({node: list(steps) for node, steps in saved.items()}, num_nodes)
    if step is None:
        return None
    newer = {node: max(steps) for node, steps in saved.items() if steps and max(steps) > step}
    if newer:
        print(f"[checkpoint] step {step} is the newest that all {num_nodes} nodes saved; newer saves of one node "
              f"only are not used: {newer} (node: step)", flush=True)
    return saved[node_index].get(step)


def gang_size_of_run(run) -> int:
    """Nodes of the ``train`` gang of ``run`` (one Metaflow task per node of a ``@parallel`` step)."""
    return len(list(run["train"]))


def _run_lister(run):
    """``list_node(name)`` of the ``train`` gang of the Metaflow ``run`` (every task's checkpoints of that name)."""
    from metaflow import Checkpoint

    tasks = list(run["train"])

    def list_node(name: str) -> list[dict]:
        return list({c["key"]: c for task in tasks for c in Checkpoint().list(task=task, name=name)}.values())

    return list_node


def _newest_of_run(run, node_index: int, num_nodes: int | None = None) -> dict | None:
    """Node ``node_index``'s checkpoint at the newest step that every node of the ``train`` gang of ``run`` saved
    (``num_nodes``: that gang's size; None: counted from the run)."""
    num_nodes = gang_size_of_run(run) if num_nodes is None else num_nodes
    return _newest_common_checkpoint(_saved_by_node(_run_lister(run), num_nodes), node_index, num_nodes)


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


@dataclass(frozen=True)
class Reference:
    """A ``train.resume_from`` value, classified once (:func:`parse_reference`) for both the check in ``start`` and
    the load in ``train``: ``directory`` (a local trainer checkpoint, ``path`` the one found in it), ``run`` (a
    ``FlowName/run_id`` pathspec: ``flow``, ``run_id``), ``location`` (the run's S3 location, read without the
    metadata service: :mod:`grpo_steps.run_location`) or ``key`` (a metaflow-checkpoint key)."""

    text: str
    kind: Literal["directory", "run", "location", "key"]
    path: str | None = None
    flow: str | None = None
    run_id: str | None = None

    def gang(self) -> Gang:
        """The ``train`` gang of the run a ``run`` or ``location`` reference names.

        Raises:
            CheckpointNotFound: no such run, the run never reached its ``train`` step, or (a location) it lies outside
                this run's S3 datastore or cannot be read.
        """
        if self.kind == "run":
            run = self.run()
            return Gang(gang_size_of_run(run), _run_lister(run))
        from metaflow.metaflow_config import DATASTORE_SYSROOT_S3

        from grpo_steps.run_location import LocationError, parse_location, saved_gang

        try:
            saved = saved_gang(parse_location(self.text, DATASTORE_SYSROOT_S3))
        except LocationError as err:
            raise CheckpointNotFound(str(err)) from None
        return Gang(saved.nodes, saved.list_node)

    def run(self):
        """The Metaflow ``Run`` a ``run`` reference names (this datastore and namespace).

        Raises:
            CheckpointNotFound: no such flow or run, or the run never reached its ``train`` step.
        """
        from metaflow import Flow
        from metaflow.exception import MetaflowNotFound

        try:
            run = Flow(self.flow)[self.run_id]
        except (MetaflowNotFound, KeyError) as err:  # no such flow / no such run
            raise CheckpointNotFound(f"train.resume_from {self.text!r}: no such run in this datastore/namespace "
                                     f"({err}); give 'FlowName/run_id', a checkpoint key or a directory") from None
        if "train" not in run:
            raise CheckpointNotFound(f"train.resume_from {self.text!r}: that run never reached its train step")
        return run

    def newest_of_node(self, gang: Gang, node_index: int) -> dict:
        """Node ``node_index``'s checkpoint at the newest step that every node of ``gang`` (:meth:`gang`) saved.

        Raises:
            CheckpointNotFound: there is no such step.
        """
        newest = _newest_common_checkpoint(_saved_by_node(gang.list_node, gang.nodes), node_index, gang.nodes)
        if newest is None:
            raise CheckpointNotFound(f"train.resume_from {self.text!r}: that run saved no checkpoint for node "
                                     f"{node_index}")
        return newest


@dataclass(frozen=True)
class Gang:
    """A saved run's ``train`` gang: ``nodes`` (its size) and ``list_node(name)`` (every checkpoint of that name its
    tasks saved, as ``Checkpoint().list`` gives them)."""

    nodes: int
    list_node: Callable[[str], list[dict]]


def parse_reference(reference: str) -> Reference:
    """Classify a ``train.resume_from`` value: an existing local directory, else a run's S3 location (``s3://...``),
    else a ``FlowName/run_id`` pathspec (two parts, not a path: no leading ``/``, ``.`` or ``~``), else a checkpoint
    key.

    Raises:
        CheckpointNotFound: a directory without a trainer checkpoint (``trainer_state.json``) in it or in its
            ``checkpoint-*`` subdirectories.

    >>> parse_reference("GRPOFlow/1234").kind, parse_reference("./GRPOFlow/1234").kind
    ('run', 'key')
    """
    local = Path(reference).expanduser()
    if local.is_dir():
        found = trainer_checkpoint_in(local)
        if not found:
            raise CheckpointNotFound(f"train.resume_from {reference!r}: no trainer checkpoint (trainer_state.json) "
                                     "in that directory or its checkpoint-* subdirectories")
        return Reference(reference, "directory", path=found)
    if reference.startswith("s3://"):
        return Reference(reference, "location")
    parts = reference.strip("/").split("/")
    if len(parts) == 2 and not reference.startswith(("/", ".", "~")):
        return Reference(reference, "run", flow=parts[0], run_id=parts[1])
    return Reference(reference, "key")


def _load_gang(ref: Reference, gang: Gang) -> str:
    """The checkpoints every node of ``gang`` (another number of nodes) saved of their newest common step, loaded
    into ``node<i>/`` of this task's checkpoint directory and merged into ``merged/``
    (:func:`grpo_steps.elastic.merge_node_checkpoints`), for a gang of another number of nodes.

    Raises:
        CheckpointNotFound: a node of that gang saved no checkpoint.
    """
    from metaflow import current

    from grpo_steps.elastic import merge_node_checkpoints

    root = Path(current.checkpoint.directory)
    loaded = []
    for node in range(gang.nodes):
        newest = ref.newest_of_node(gang, node)
        print(f"[checkpoint] loading node {node}'s step {newest['metadata']['global_step']} of run {ref.text} "
              f"(saved by {gang.nodes} nodes)", flush=True)
        current.checkpoint.load(newest, path=str(root / f"node{node}"))
        loaded.append(trainer_checkpoint_in(root / f"node{node}"))
    if not all(loaded):
        raise CheckpointNotFound(f"train.resume_from {ref.text!r}: a node's checkpoint holds no trainer state")
    return merge_node_checkpoints(loaded, root / "merged")


def _not_a_reference(reference: str, err: BaseException) -> CheckpointNotFound:
    return CheckpointNotFound(f"train.resume_from {reference!r} is not a directory, a 'FlowName/run_id' pathspec or "
                              f"a checkpoint key in this datastore ({type(err).__name__}: {err})")


def resolve_reference(reference: str, node_index: int) -> str:
    """Trainer checkpoint directory for a ``train.resume_from`` reference (:func:`parse_reference`), loaded from the
    datastore when it is a run pathspec or a checkpoint key. Call inside the ``train`` step.

    Raises:
        CheckpointNotFound: the directory holds no trainer checkpoint, the run does not exist or has
            no checkpoint of this node, or the key does not load.
    """
    ref = parse_reference(reference)
    if ref.kind == "directory":
        print(f"[checkpoint] resuming from local directory {ref.path}", flush=True)
        return ref.path
    if ref.kind in ("run", "location"):
        gang = ref.gang()
        if gang.nodes != this_gang_size():  # a resize: every saved node's partitions, in one checkpoint
            return _load_gang(ref, gang)
        newest = ref.newest_of_node(gang, node_index)
        return _load(newest, f"step {newest['metadata']['global_step']} of run {reference}")
    try:
        return _load(reference, f"checkpoint key {reference}")
    except CheckpointNotFound as err:
        raise CheckpointNotFound(f"train.resume_from {reference!r}: {err}") from None
    except Exception as err:  # metaflow-checkpoint raises several types for a bad key
        raise _not_a_reference(reference, err) from err


def check_reference(reference: str, num_nodes: int = 1) -> str:
    """Check a ``train.resume_from`` reference (:func:`parse_reference`) without loading it (before any server
    starts); returns what it names, for the log.

    A directory must hold a trainer checkpoint; a ``FlowName/run_id`` pathspec must name a run of this
    datastore and namespace whose ``train`` step saved a checkpoint of a common step for each of its gang's nodes
    (``num_nodes``: this run's, which may differ: :mod:`grpo_steps.elastic`); so must a run's S3 location, read
    without the metadata service (:mod:`grpo_steps.run_location`), which must lie under this run's S3 datastore;
    anything else must be a checkpoint key whose metadata is in the datastore.

    Raises:
        CheckpointNotFound: the reference names none of these; the message names it and what to give.
    """
    ref = parse_reference(reference)
    if ref.kind == "directory":
        return f"local directory {ref.path}"
    if ref.kind in ("run", "location"):
        gang = ref.gang()  # the saving gang's nodes; this run's may differ (an elastic resume)
        saved_nodes = gang.nodes
        steps = [ref.newest_of_node(gang, node)["metadata"]["global_step"] for node in range(saved_nodes)]
        return f"run {reference}, step {steps[0]}" + (f" (nodes: {steps})" if saved_nodes > 1 else "") + \
            (f", saved by {saved_nodes} nodes, continued on {num_nodes}" if saved_nodes != num_nodes else "")
    from metaflow_extensions.obcheckpoint.plugins.machine_learning_utilities.datastructures import (
        CheckpointArtifact,
    )

    # metaflow-checkpoint 0.2 has no public look-up of a key's metadata (pinned by tests/unit/test_private_apis.py)
    try:
        found = CheckpointArtifact._load_metadata_from_key(reference, None)
    except Exception as err:  # metaflow-checkpoint raises several types for a bad key
        raise _not_a_reference(reference, err) from None
    return f"checkpoint key {reference} ({found.name}, version {found.version_id})"


def this_gang_size() -> int:
    """Nodes of the running ``@parallel`` gang (1 outside one)."""
    from metaflow import current

    parallel = getattr(current, "parallel", None)
    return int(getattr(parallel, "num_nodes", 1) or 1)


def resume_checkpoint(node_index: int, configured: str | None = None) -> str | None:
    """Trainer checkpoint directory the current ``train`` task continues from, or None (start fresh).

    In order: ``@retry``: this node's checkpoint at the newest step that every node of the gang saved (earlier
    attempts; :func:`newest_common_step`); ``resume``: the same in the origin run's ``train`` step; else
    ``configured`` (``train.resume_from``, see :func:`resolve_reference`). Call inside the ``train``
    step of a flow.

    Raises:
        CheckpointNotFound: as :func:`resolve_reference`.
    """
    from metaflow import Flow, current

    if current.retry_count:
        num_nodes = this_gang_size()
        # every attempt of the gang, every node: the nodes share one checkpoint scope
        saved = _saved_by_node(lambda name: current.checkpoint.list(name=name), num_nodes)
        newest = _newest_common_checkpoint(saved, node_index, num_nodes)
        if newest is not None:
            return _load(newest, f"this task's step {newest['metadata']['global_step']} (retry)")
    if current.origin_run_id:
        newest = _newest_of_run(Flow(current.flow_name)[current.origin_run_id], node_index)
        if newest is not None:
            return _load(newest, f"step {newest['metadata']['global_step']} of run {current.origin_run_id}")
    return resolve_reference(configured, node_index) if configured else None
