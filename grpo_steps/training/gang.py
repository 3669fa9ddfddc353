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
