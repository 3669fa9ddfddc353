"""What a checkpoint records for a resume on another gang: the gang that saved it (:data:`grpo_steps.elastic.GANG_FILE`)
and the prompt cursor (:data:`grpo_steps.training.cursor.CURSOR_FILE`), written into each ``checkpoint-N`` before the
datastore upload (:class:`grpo_steps.training.callbacks.DatastoreCheckpointCallback`) reads it; and the repair of
what DeepSpeed's universal load leaves wrong in the optimizer (:class:`RepairUniversalLoad`)."""

from __future__ import annotations

import os
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


def saved_param_groups(checkpoint: str | os.PathLike) -> list[dict]:
    """The optimizer's parameter groups (their settings; ``params`` as indices) in the Universal Checkpoint of the
    trainer checkpoint ``checkpoint`` (``<latest_universal>/zero/optimizer_state.pt``, written by ``ds_to_universal``
    from the base optimizer's state dict: every group, in order). Unpickled as DeepSpeed itself loads it (a resumed
    ZeRO checkpoint is trusted: ``train.trust_checkpoint``)."""
    import torch

    checkpoint = Path(checkpoint)
    tag = (checkpoint / "latest_universal").read_text().strip()
    state = torch.load(checkpoint / tag / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    return state["optimizer_state_dict"]["param_groups"]


def restore_group_settings(optimizer, saved_groups: list[dict]) -> int:
    """Give each parameter group back its own settings (``weight_decay``, ``betas``, ``lr``, ...) from
    ``saved_groups`` (:func:`saved_param_groups`, group ``i`` for group ``i``); returns how many settings changed.
    DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) copies the
    settings of the checkpoint's group 0 onto every group: with transformers' decay / no-decay groups, the no-decay
    parameters (biases, norm weights) are then decayed from the first resumed step on (measured with weight_decay
    1.0: the second resumed step's grad norm 7.6e-5 relative off, the same process count reloading its own
    checkpoint). ``optimizer``: the trainer's (accelerate's wrapper of DeepSpeed's, of torch's).

    Raises:
        ValueError: the checkpoint holds another number of groups than the optimizer (another model or LoRA shape,
            which :func:`grpo_steps.elastic.refusal` refuses before the run starts).
    """
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    groups = optimizer.param_groups
    if len(groups) != len(saved_groups):
        raise ValueError(f"the Universal Checkpoint holds {len(saved_groups)} optimizer parameter groups, the "
                         f"optimizer {len(groups)}: it was saved for another model or LoRA shape")
    changed = 0
    for group, saved in zip(groups, saved_groups, strict=True):
        for key, value in saved.items():
            if key != "params" and group.get(key) != value:
                group[key] = value
                changed += 1
    return changed


class RepairUniversalLoad(TrainerCallback):
    """At train begin (after the checkpoint is loaded), for a job that loads a Universal Checkpoint
    (``TrainJob.resume_universal``) from ``checkpoint``: each parameter group's own settings back
    (:func:`restore_group_settings`), then :func:`separate_step_counts` of the trainer's optimizer."""

    def __init__(self, checkpoint: str | os.PathLike) -> None:
        self.checkpoint = checkpoint

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None:
            return control
        settings = restore_group_settings(optimizer, saved_param_groups(self.checkpoint))
        counts = separate_step_counts(optimizer)
        if state.is_world_process_zero and (settings or counts):
            print(f"[checkpoint] universal load repaired: {settings} parameter-group settings put back (DeepSpeed "
                  f"gives every group group 0's), {counts} Adam step counts made one per group on the device its "
                  "kernel reads them from (DeepSpeed shares one CPU tensor)", flush=True)
        return control
