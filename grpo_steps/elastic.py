"""Elastic resume: continue a trainer checkpoint on a gang of another size (``train.num_nodes`` x
``train.processes_per_node``), before the training process starts.

Every checkpoint carries the gang that saved it (:data:`GANG_FILE`, written by
:class:`grpo_steps.training.gang.GangManifestCallback`): nodes, processes per node, ZeRO stage, the model, the LoRA
shape, the optimizer and the prompts per optimizer step. :func:`prepare_resume` (called by
:func:`grpo_steps.launch.launch` on each node) compares it with the job's gang and

- refuses what cannot continue (another model, LoRA shape, optimizer, ZeRO use, or another number of prompts per
  optimizer step), with the reason and the fix, before any training process starts (:class:`ResumeRefused`);
- with ZeRO and another number of processes, converts the checkpoint once to DeepSpeed's Universal Checkpoint
  (``deepspeed.checkpoint.ds_to_universal``: ``global_stepN_universal/`` and ``latest_universal`` beside
  ``global_stepN/``; a later resume reuses it), and the job then loads it (``checkpoint.load_universal``);
- gives each new process an RNG state: process 0's saved stream (per-rank streams cannot be split or merged: a new
  process has no saved stream of its own; they are equal when every process drew alike, as on the CPU paths here);
- prints ``[checkpoint] resuming step N saved by 2 nodes x 1 process on 1 node x 2 processes (universal conversion
  12.3 s)`` and tags the MLflow run (``resume/*``).

Plain DDP and one-process checkpoints hold full replicas (of the adapter, with LoRA): they need no conversion. LoRA
under ZeRO-3 is converted like full training: the optimizer's partitions hold the adapter only (the frozen base is
the model's).

This module imports neither torch nor DeepSpeed at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GANG_FILE = "gang.json"
"""The gang a trainer checkpoint was saved by, in the checkpoint directory (:class:`Gang` as JSON)."""


class ResumeRefused(ValueError):
    """A checkpoint that this job cannot continue; the message says what differs and how to fix it."""


@dataclass(frozen=True)
class Gang:
    """The training gang of a run, and what a checkpoint of it can be continued with.

    ``zero_stage``: 0 without DeepSpeed; ``peft``: the LoRA shape (``r``, ``alpha``, ``target_modules``) or None;
    ``prompts_per_step``: distinct prompts per optimizer step (``per_device_train_batch_size`` x
    ``gradient_accumulation_steps`` x world size / ``num_generations``)."""

    num_nodes: int
    processes_per_node: int
    zero_stage: int
    model: str
    peft: dict | None
    optimizer: str
    prompts_per_step: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.processes_per_node

    def layout(self) -> str:
        """``2 nodes x 1 process``."""
        def plural(n: int, word: str, suffix: str = "s") -> str:
            return f"{n} {word}{suffix if n != 1 else ''}"

        return f"{plural(self.num_nodes, 'node')} x {plural(self.processes_per_node, 'process', 'es')}"


def gang_of(cfg) -> Gang:
    """The gang of a :class:`grpo_steps.config.PipelineConfig`. The optimizer is ``train.grpo.optim`` (transformers'
    default ``adamw_torch`` otherwise); a fused and an unfused implementation keep the same state, so ``_fused`` is
    dropped from the name."""
    train = cfg.train
    modules = train.peft.target_modules if train.peft else None
    peft = None if train.peft is None else {"r": train.peft.r, "alpha": train.peft.alpha,
                                            "target_modules": sorted(modules) if isinstance(modules, list) else modules}
    rows = train.per_device_train_batch_size * train.gradient_accumulation_steps * train.world_size
    optimizer = str(train.grpo.get("optim", "adamw_torch")).removesuffix("_fused")
    return Gang(num_nodes=train.num_nodes, processes_per_node=train.processes_per_node,
                zero_stage=3 if train.deepspeed else 0, model=cfg.model.name_or_path, peft=peft,
                optimizer=optimizer, prompts_per_step=rows // train.num_generations)


def write_gang(checkpoint: str | os.PathLike, gang: Gang) -> None:
    """Record ``gang`` in the trainer checkpoint directory ``checkpoint``."""
    (Path(checkpoint) / GANG_FILE).write_text(json.dumps(asdict(gang), indent=1))


def read_gang(checkpoint: str | os.PathLike) -> Gang | None:
    """The gang that saved ``checkpoint``, or None for a checkpoint saved before gangs were recorded."""
    path = Path(checkpoint) / GANG_FILE
    return Gang(**json.loads(path.read_text())) if path.exists() else None


def refusal(saved: Gang, new: Gang) -> str | None:
    """Why a checkpoint of ``saved`` cannot be continued by ``new``, or None when it can.

    >>> g = Gang(2, 1, 3, "m", None, "adamw_torch", 2)
    >>> refusal(g, Gang(1, 2, 3, "m", None, "adamw_torch", 2)) is None
    True
    >>> refusal(g, Gang(1, 1, 3, "other", None, "adamw_torch", 2))
    "the checkpoint trained model 'm', this run trains 'other': set model.name_or_path: 'm'"
    """
    if saved.model != new.model:
        return f"the checkpoint trained model {saved.model!r}, this run trains {new.model!r}: set " \
               f"model.name_or_path: {saved.model!r}"
    if saved.peft != new.peft:
        return f"the checkpoint holds LoRA {saved.peft or 'none (full fine-tuning)'}, this run's train.peft is " \
               f"{new.peft or 'none'}: the optimizer state belongs to the checkpoint's trainable parameters; set " \
               "train.peft as the checkpoint's"
    if saved.optimizer != new.optimizer:
        return f"the checkpoint's optimizer state is {saved.optimizer!r}'s, this run uses {new.optimizer!r}: set " \
               f"train.grpo.optim: {saved.optimizer!r}"
    if bool(saved.zero_stage) != bool(new.zero_stage):
        return f"the checkpoint was saved {'with' if saved.zero_stage else 'without'} DeepSpeed ZeRO, this run " \
               f"trains {'with' if new.zero_stage else 'without'}: set train.deepspeed: {bool(saved.zero_stage)}"
    if saved.prompts_per_step != new.prompts_per_step:
        return f"the checkpoint trained {saved.prompts_per_step} prompts per optimizer step, this run " \
               f"{new.prompts_per_step}: the data order, the epoch and the learning-rate schedule are counted in " \
               "those steps; keep train.per_device_train_batch_size x gradient_accumulation_steps x num_nodes x " \
               "processes_per_node / num_generations equal to the checkpoint's (e.g. double " \
               "per_device_train_batch_size when the processes are halved)"
    return None


def saved_world_size(checkpoint: str | os.PathLike) -> int | None:
    """Processes that saved a checkpoint, from its files (for checkpoints without :data:`GANG_FILE`): ZeRO partitions
    (one ``zero_pp_rank_<r>_*optim_states.pt`` per process), else per-process RNG states (``rng_state_<i>.pth``; one
    ``rng_state.pth`` for a single process); None when neither tells (a node's share of a multi-node gang holds only
    its own processes' files, so this counts them only)."""
    checkpoint = Path(checkpoint)
    tag = zero_tag(checkpoint)
    ranks = len(list((checkpoint / tag).glob("zero_pp_rank_*optim_states.pt"))) if tag else 0
    if ranks:
        return ranks
    states = len(list(checkpoint.glob("rng_state_*.pth")))
    return states or (1 if (checkpoint / "rng_state.pth").exists() else None)


def zero_tag(checkpoint: Path) -> str | None:
    """The ZeRO checkpoint tag (``global_stepN``) in a trainer checkpoint, or None without DeepSpeed files."""
    latest = checkpoint / "latest"
    if latest.exists():
        return latest.read_text().strip()
    tags = sorted(p.name for p in checkpoint.glob("global_step*") if not p.name.endswith("_universal"))
    return tags[-1] if tags else None


def to_universal(checkpoint: str | os.PathLike) -> float | None:
    """Convert the ZeRO partitions of ``checkpoint`` (all ranks' files in ``global_stepN/``) to DeepSpeed's Universal
    Checkpoint ``global_stepN_universal/`` beside them, with the ``latest_universal`` tag DeepSpeed's
    ``load_universal`` reads. Returns the seconds it took, or None when the conversion was already there (a resume
    that failed after converting, then retried). Peak memory: about one rank's optimizer partition per extract worker
    plus one full parameter's fragments while merging (``docs/benchmarks.md``).

    Raises:
        ResumeRefused: no ZeRO partitions in ``checkpoint``.
    """
    checkpoint = Path(checkpoint)
    tag = zero_tag(checkpoint)
    if tag is None:
        raise ResumeRefused(f"{checkpoint} holds no DeepSpeed ZeRO partitions (global_step*/) to convert")
    output = checkpoint / f"{tag}_universal"
    if (checkpoint / "latest_universal").exists() and (output / "zero").is_dir():
        return None
    import subprocess
    import sys

    started = time.perf_counter()
    # ds_to_universal's own defaults, with as many extract workers as cores (each holds one rank's optimizer
    # partition), in a process of its own: its workers are forked, and forking a process that has initialised CUDA
    # hangs them (on an H200, 2026-11-27: stuck at "Extracting ZeRO fragments" when called in this process)
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(checkpoint / tag), "--output_folder", str(output),
                           "--num_extract_workers", str(max(1, min(4, os.cpu_count() or 1))),
                           "--num_merge_workers", "1"], check=False)
    if done.returncode != 0:
        shutil.rmtree(output, ignore_errors=True)  # a half-converted checkpoint is never loaded
        raise ResumeRefused(f"DeepSpeed's Universal Checkpoint conversion of {checkpoint / tag} failed (exit code "
                            f"{done.returncode}; its output is above)")
    return time.perf_counter() - started


def spread_rng_states(checkpoint: str | os.PathLike, new_world: int) -> None:
    """Give each of ``new_world`` processes an RNG state file as transformers' ``Trainer`` reads them
    (``rng_state.pth`` for one process, ``rng_state_<i>.pth`` for several): process 0's saved state for every new
    process that has none of its own."""
    checkpoint = Path(checkpoint)
    source = next((checkpoint / name for name in ("rng_state_0.pth", "rng_state.pth")
                   if (checkpoint / name).exists()), None)
    if source is None:
        return
    targets = ["rng_state.pth"] if new_world == 1 else [f"rng_state_{i}.pth" for i in range(new_world)]
    for name in targets:
        if not (checkpoint / name).exists():
            shutil.copyfile(source, checkpoint / name)


@dataclass(frozen=True)
class ResumePlan:
    """What :func:`prepare_resume` decided: the checkpoint's step and gang, this job's gang, whether the training
    process loads a Universal Checkpoint, and the conversion's seconds (None: none ran)."""

    step: int
    saved: Gang
    new: Gang
    universal: bool
    conversion_s: float | None

    def line(self) -> str:
        """The log line of a resize."""
        conversion = "" if not self.universal else \
            f" (universal conversion {self.conversion_s:.1f} s)" if self.conversion_s is not None else \
            " (universal checkpoint converted before)"
        return f"[checkpoint] resuming step {self.step} saved by {self.saved.layout()} on {self.new.layout()}" \
               + conversion

    def tags(self) -> dict[str, str]:
        """MLflow tags of the run."""
        tags = {"resume/step": str(self.step), "resume/saved_gang": self.saved.layout(),
                "resume/gang": self.new.layout(), "resume/universal": str(self.universal).lower()}
        if self.conversion_s is not None:
            tags["resume/universal_conversion_s"] = f"{self.conversion_s:.2f}"
        return tags


def prepare_resume(checkpoint: str | os.PathLike, new: Gang) -> ResumePlan | None:
    """Make the trainer checkpoint ``checkpoint`` resumable by gang ``new`` (see the module's docstring). Returns the
    plan, or None when the checkpoint records no gang (saved before gangs were recorded: resumed as is, by the same
    gang) or was saved by the same world size and layout.

    Raises:
        ResumeRefused: :func:`refusal`'s reason.
    """
    checkpoint = Path(checkpoint)
    saved = read_gang(checkpoint)
    if saved is None:
        world = saved_world_size(checkpoint)
        # a single node's checkpoint holds every process's files; a node's share of a gang its own processes' only
        if world not in (None, new.world_size, new.processes_per_node):
            raise ResumeRefused(f"cannot resume {checkpoint} on {new.world_size} processes: it was saved by {world} "
                                f"processes before checkpoints recorded their gang ({GANG_FILE}), so it can be "
                                f"continued only by {world} processes (train.num_nodes x train.processes_per_node)")
        return None
    reason = refusal(saved, new)
    if reason:
        raise ResumeRefused(f"cannot resume {checkpoint}: {reason}")
    if saved.world_size == new.world_size and saved.num_nodes == new.num_nodes:
        return None
    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    universal = bool(saved.zero_stage) and saved.world_size != new.world_size
    seconds = to_universal(checkpoint) if universal else None
    spread_rng_states(checkpoint, new.world_size)
    return ResumePlan(step, saved, new, universal, seconds)


def merge_node_checkpoints(node_checkpoints: list[str | os.PathLike], target: str | os.PathLike) -> str:
    """One trainer checkpoint at ``target`` from the checkpoints each node of a gang saved of the same step (node
    order): node 0's files, plus every other node's ZeRO partitions (``global_stepN/``) and per-process RNG states,
    which each node holds only for its own processes. A gang of another number of nodes resumes from it
    (:func:`prepare_resume` converts the partitions together). Returns ``target``.

    Raises:
        ResumeRefused: the nodes saved different steps.
    """
    sources = [Path(p) for p in node_checkpoints]
    steps = {json.loads((p / "trainer_state.json").read_text())["global_step"] for p in sources}
    if len(steps) != 1:
        raise ResumeRefused(f"the nodes' checkpoints {[str(p) for p in sources]} hold different steps {sorted(steps)}")
    target = Path(target)
    shutil.copytree(sources[0], target, dirs_exist_ok=True)
    for source in sources[1:]:
        for path in [*source.glob("global_step*/*"), *source.glob("rng_state_*.pth")]:
            destination = target / path.relative_to(source)
            if not destination.exists():  # a rank's own file is in one node's checkpoint only
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, destination)
    return str(target)
