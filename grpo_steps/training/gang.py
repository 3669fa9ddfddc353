"""What a checkpoint records for a resume on another gang: the gang that saved it (:data:`grpo_steps.elastic.GANG_FILE`)
and the prompt cursor (:data:`grpo_steps.training.cursor.CURSOR_FILE`), written into each ``checkpoint-N`` before the
datastore upload (:class:`grpo_steps.training.callbacks.DatastoreCheckpointCallback`) reads it."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from grpo_steps.elastic import gang_of, write_gang
from grpo_steps.training.cursor import PromptCursor


class GangManifestCallback(TrainerCallback):
    """After each trainer save, on the local main process of each node (each node keeps its own copy of the
    checkpoint), write the gang of ``cfg`` (:func:`grpo_steps.elastic.gang_of`) and ``cursor``'s state into it. Place
    it before the datastore callback: callbacks run in their list's order."""

    def __init__(self, cfg, cursor: PromptCursor | None) -> None:
        self.gang, self.cursor = gang_of(cfg), cursor

    def on_save(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_gang(path, self.gang)
            if self.cursor is not None:
                self.cursor.save(path)
        return control


def separate_step_counts(optimizer) -> int:
    """Give each parameter group's Adam state its own ``step`` tensor where several share one, on the device torch's
    Adam expects it (the parameter's for the fused and capturable kernels, else the CPU); returns how many were
    replaced. DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    stores the same ``step`` tensor object in the state of every sub-group, and torch's Adam increments it in place
    once per group: with two groups (transformers' decay / no-decay) the count then runs two per optimizer step, and
    the bias correction of the second group is wrong from the first resumed step on (measured: the next step's grad
    norm 1.2e-4 relative off the uninterrupted run's, the same for a single process reloading its own checkpoint).
    ``optimizer``: the trainer's (accelerate's wrapper of DeepSpeed's, of torch's)."""
    import torch

    while hasattr(optimizer, "optimizer"):  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> torch's
        optimizer = optimizer.optimizer
    seen, changed = set(), 0
    # torch's Adam keeps the count on the parameter's device for its fused and capturable kernels, else on the CPU
    # (Adam._init_group); DeepSpeed's universal load leaves it on the CPU, which the fused kernel refuses (on an H200,
    # 2026-11-27: "state_steps is on cpu, different from other tensors on cuda:0"). The state is walked, not the
    # groups: ZeRO-3 swaps each sub-group's flat partition into param_groups only while it steps it.
    groups = optimizer.param_groups
    on_device = any(g.get("fused") or g.get("capturable") for g in groups)
    for param, state in optimizer.state.items():
        step = state.get("step")
        if not torch.is_tensor(step):
            continue
        device = param.device if on_device and torch.is_tensor(param) else torch.device("cpu")
        if id(step) in seen or step.device != device:
            state["step"] = step.detach().clone().to(device)
            changed += 1
        seen.add(id(state["step"]))
    return changed


class SeparateStepCounts(TrainerCallback):
    """At train begin (after the checkpoint is loaded), :func:`separate_step_counts` of the trainer's optimizer: for a
    job that loads a Universal Checkpoint (``TrainJob.resume_universal``)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and separate_step_counts(optimizer) and state.is_world_process_zero:
            print("[checkpoint] universal load: one Adam step count per parameter group again, on the device its "
                  "kernel reads it from (DeepSpeed shares one CPU tensor between them)", flush=True)
        return control
