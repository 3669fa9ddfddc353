"""Training checkpoints in the Metaflow datastore (metaflow-checkpoint).

The trainer writes a full checkpoint (weights, optimizer, scheduler, RNG, trainer state) to
``output_dir/checkpoint-N`` every ``save_steps``; :class:`DatastoreCheckpointCallback` then saves
that directory to the datastore of the running task (local or S3) under ``CHECKPOINT_NAME`` with
``{"global_step": N}`` metadata. On ``@retry`` the ``@checkpoint`` decorator loads the newest one
into ``current.checkpoint.directory``; :func:`trainer_checkpoint_in` finds it there.
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
    """After each trainer save (rank 0), copy the new ``checkpoint-N`` directory to the datastore."""

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        from metaflow import Checkpoint

        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        Checkpoint().save(path=str(path), metadata={"global_step": state.global_step}, name=CHECKPOINT_NAME)
        return control


def trainer_checkpoint_in(directory: str | os.PathLike | None) -> str | None:
    """The trainer checkpoint held in a loaded ``@checkpoint`` directory, or None when it holds none."""
    if not directory:
        return None
    directory = Path(directory)
    if (directory / "trainer_state.json").exists():
        return str(directory)
    candidates = sorted(directory.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return str(candidates[-1]) if candidates else None
