"""The data cursor: the training prompts consumed so far, by id, in the current epoch (not a per-process position),
saved in every checkpoint and read back on resume, whatever the gang's size.

A prompt is consumed when the trainer generates its group for training (every process's share, gathered); a
generation batch that the asynchronous producer sampled too stale and dropped is sampled again with the same prompts
and consumed once, when the trainer takes it (trl #7274: there a drop left a gap in the consumed ids that pinned the
resume position). :class:`CursorSampler` is TRL's ``RepeatSampler`` order (same seed, same permutation per epoch,
same chunks and repeats) with the consumed prompts of the resumed epoch left out, so that after a resume (on any gang)
no prompt of the epoch is trained twice and none is skipped. Epoch ``e``'s permutation is the ``e+1``-th draw of a
generator seeded with the seed, as an uninterrupted ``RepeatSampler`` draws it (TRL's own sampler restarts its
generator in a resumed process).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

CURSOR_FILE = "prompt_cursor.json"
"""The cursor in a trainer checkpoint directory: ``{"epoch": e, "consumed": [ids]}``."""
PROMPTS_LOG = "prompts.jsonl"
"""Main process: one line per training generation batch in ``output_dir``: ``{"step": optimizer step being trained,
"epoch": e, "ids": [prompt ids of every process]}``."""


def prompt_id(prompt) -> str:
    """A prompt's id: 16 hex digits of the SHA-256 of its JSON (the prepared train split holds each prompt once).

    >>> prompt_id([{"role": "user", "content": "1+1"}]) == prompt_id([{"content": "1+1", "role": "user"}])
    True
    """
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


class PromptCursor:
    """The consumed prompts of the current epoch.

    Args:
        ids: the prompt id of each row of the training dataset, in its order.
        prompts_per_epoch: prompts an epoch trains (TRL drops the last incomplete generation batch).
        epoch, consumed: where a checkpoint's cursor stood (:meth:`load`); a fresh run starts at 0, empty.
    """

    def __init__(self, ids: list[str], prompts_per_epoch: int, epoch: int = 0,
                 consumed: Iterable[str] = ()) -> None:
        self.ids, self.prompts_per_epoch = ids, prompts_per_epoch
        self.epoch, self.consumed = epoch, set(consumed)
        self.resumed_epoch, self.resumed_consumed = epoch, frozenset(self.consumed)

    def consume(self, ids: Iterable[str]) -> None:
        """Record a generation batch's prompts (every process's, repeats allowed); the epoch ends when all its
        prompts are consumed."""
        self.consumed.update(ids)
        if len(self.consumed) >= self.prompts_per_epoch:
            self.epoch, self.consumed = self.epoch + 1, set()

    def state(self) -> dict:
        return {"epoch": self.epoch, "consumed": sorted(self.consumed)}

    def save(self, checkpoint: str | os.PathLike) -> None:
        """Write the cursor into a trainer checkpoint directory."""
        (Path(checkpoint) / CURSOR_FILE).write_text(json.dumps(self.state()))

    @classmethod
    def load(cls, ids: list[str], prompts_per_epoch: int, checkpoint: str | os.PathLike | None) -> PromptCursor:
        """The cursor saved in ``checkpoint`` (None, or a checkpoint saved before cursors were: a fresh cursor,
        and the resume skips by position as transformers' ``Trainer`` does).

        Raises:
            ValueError: the checkpoint consumed prompts that this run's training set does not hold (another data
                set or split).
        """
        path = Path(checkpoint) / CURSOR_FILE if checkpoint else None
        if path is None or not path.exists():
            return cls(ids, prompts_per_epoch)
        saved = json.loads(path.read_text())
        unknown = set(saved["consumed"]) - set(ids)
        if unknown:
            raise ValueError(f"{path}: {len(unknown)} consumed prompts are not in this run's training set: the "
                             "checkpoint trained other data (data.* must be the checkpoint's)")
        return cls(ids, prompts_per_epoch, saved["epoch"], saved["consumed"])


class CursorSampler(torch.utils.data.Sampler):
    """TRL's ``RepeatSampler`` order, resumed from a :class:`PromptCursor`: epochs from the cursor's on; in the
    resumed epoch the first ``skip_positions()`` indices (those transformers' ``Trainer`` skips by position on resume)
    are the epoch's own, and the rest is the epoch's order without the consumed prompts, cut into generation batches
    anew. With a checkpoint at a generation batch's end and the same prompts per generation batch this is exactly
    ``RepeatSampler``'s sequence (a same-size resume stays bit-identical).

    Args:
        base: TRL's sampler (``num_samples``, ``batch_size`` prompts per generation batch, ``mini_repeat_count``,
            ``repeat_count``, ``shuffle``, ``seed``).
        cursor: the run's :class:`PromptCursor` (its ``resumed_*`` fields: where this attempt started).
        skip_positions: indices the trainer skips at the start of the resumed epoch (evaluated at its first pass).
    """

    def __init__(self, base, cursor: PromptCursor, skip_positions: Callable[[], int]) -> None:
        self.n, self.chunk = base.num_samples, base.batch_size
        self.mini, self.repeat = base.mini_repeat_count, base.repeat_count
        self.shuffle, self.seed = base.shuffle, base.seed
        self.cursor, self.skip_positions = cursor, skip_positions
        self.length = len(base)
        self.next_epoch = cursor.resumed_epoch

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the dataset's rows (``RepeatSampler``'s ``epoch+1``-th draw)."""
        if not self.shuffle:
            return list(range(self.n))
        generator = torch.Generator()
        if self.seed is not None:
            generator.manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.n, generator=generator)
        return torch.randperm(self.n, generator=generator).tolist()

    def expand(self, rows: list[int]) -> list[int]:
        """``rows`` as ``RepeatSampler`` yields them: whole generation batches, each repeated, each prompt
        ``mini_repeat_count`` times in a row."""
        out = []
        for start in range(0, len(rows) - self.chunk + 1, self.chunk):
            for _ in range(self.repeat):
                for index in rows[start:start + self.chunk]:
                    out.extend([index] * self.mini)
        return out

    def __iter__(self) -> Iterator[int]:
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        full = self.expand(self.order(epoch))
        consumed = self.cursor.resumed_consumed
        if epoch != self.cursor.resumed_epoch or not consumed:
            yield from full
            return
        skip = self.skip_positions()
        rest = [i for i in self.order(epoch) if self.cursor.ids[i] not in consumed]
        yield from full[:skip] + self.expand(rest)

    def __len__(self) -> int:
        return self.length


def prompts_per_epoch(num_rows: int, prompts_per_generation_batch: int) -> int:
    """Prompts an epoch trains: whole generation batches only (``RepeatSampler`` drops the rest).

    >>> prompts_per_epoch(16, 2), prompts_per_epoch(17, 4)
    (16, 16)
    """
    return num_rows // prompts_per_generation_batch * prompts_per_generation_batch


def log_batch(output_dir: str | os.PathLike, step: int, epoch: int, ids: list[str]) -> None:
    """Append a training generation batch's prompt ids to :data:`PROMPTS_LOG` (main process)."""
    with open(Path(output_dir) / PROMPTS_LOG, "a") as log:
        log.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")


def resume_skip_positions(positions_per_epoch: int, rows: int, accumulation: int, global_step: int) -> int:
    """Sampler indices transformers' ``Trainer`` skips on resume (``_init_training_state``: the optimizer steps of
    the resumed epoch, in micro-batches, each ``rows`` = ``generation_batch_size`` rows over all processes;
    ``accumulation``: ``gradient_accumulation_steps``; ``global_step``: the optimizer steps the checkpoint trained).

    >>> resume_skip_positions(16, 2, 2, 5)  # 8 micro-batches = 4 optimizer steps an epoch; step 5 is the 2nd of one
    4
    """
    micro_batches = positions_per_epoch // rows
    per_epoch = max(micro_batches // accumulation + int(micro_batches % accumulation > 0), 1)
    return (global_step % per_epoch) * accumulation * rows


def record_prompts(cursor: PromptCursor, inputs: list[dict], output_dir: str | os.PathLike, step: int,
                   main_process: bool) -> None:
    """Consume a training generation batch's prompts (``inputs``: this process's rows) on ``cursor``, every
    process's gathered (a collective: every process calls it), and log their ids at optimizer step ``step`` into
    ``output_dir`` (:func:`log_batch`, ``main_process`` only)."""
    from accelerate.utils import gather_object

    ids = list(dict.fromkeys(gather_object(list(dict.fromkeys(prompt_id(x["prompt"]) for x in inputs)))))
    epoch = cursor.epoch
    cursor.consume(ids)
    if main_process:
        log_batch(output_dir, step, epoch, ids)
