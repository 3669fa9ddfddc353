"""The policy's per-token log-probabilities of a GRPO batch with each distinct prompt forwarded once (shared-prefix
training).

A GRPO batch holds ``num_generations`` completions of each prompt, and TRL's scoring forwards every row whole: the
same prompt ``num_generations`` times, in the forward and again in the backward. Here the rows, ``(B, P + C)`` token
ids (the prompt left-padded to ``P``, the completion right-padded to ``C``), are forwarded in two parts:

1. the first ``P - 1`` prompt tokens of each distinct prompt (``U`` rows), once, keeping the model's KV cache;
2. that cache copied to the ``B`` rows (``index_select``), and, through it, the last prompt token and the first
   ``C - 1`` completion tokens of every row, whose hidden states TRL's fused LM head
   (``trl.trainer.utils.add_fused_lm_head``) turns into the log-probabilities of the ``C`` completion tokens; the
   rows in one group, or in two (:func:`length_groups`: the short completions padded to their own longest, the rest
   to ``C``) when one long completion would pad the others to many times their length.

Positions (``P - 1`` cached tokens: ``P - 1 ... P + C - 2``), the causal and padding masks and the model's weights are
those of the whole-row forward, so the log-probabilities, entropies and gradients are equal to float rounding: the
backward of the copy sums the ``B`` rows' gradients into the one prompt, which is the sum the whole-row forward
computes over its ``B`` copies (the backward is linear in the incoming gradient at fixed activations). Tokens through
the model drop from ``B (P + C)`` to ``U (P - 1) + B C``, and the LM head scores ``B C`` positions (off Triton
devices, e.g. on CPU, TRL's fused head projects every position of the rows, prompt included).
The technique: shared-prefix training (NVIDIA NeMo-RL's ``shared_prefix_training``; unsloth's PrefixGrouper does it
with an attention mask instead of a cache).

Not applicable, and TRL's whole-row forward is used (:func:`applies`): the loss's forward under gradient checkpointing
(transformers' checkpointed layers drop the KV cache), DeepSpeed ZeRO-3 (each forward gathers the weights again),
multimodal inputs, a MoE model's auxiliary loss, prompts of fewer than 2 tokens.
"""

from __future__ import annotations

import copy

import torch


def applies(model, prompt_length: int, extra_inputs: dict, zero3: bool = False) -> bool:
    """Whether :func:`logps_and_entropies` can score this batch for ``model`` (unwrapped from DeepSpeed/DDP; a PEFT
    model is fine): no inputs besides the token ids and mask (``extra_inputs``: TRL's multimodal and auxiliary-loss
    arguments, None or False when absent), a prompt of at least 2 tokens, no gradient checkpointing in training
    mode (its layers then drop the cache, with or without gradients: ``transformers.modeling_layers.
    GradientCheckpointingLayer``; TRL's scoring pass turns checkpointing off), and not under DeepSpeed ZeRO-3
    (``zero3``): there every forward gathers each layer's partitioned weights again, in the forward and in the
    backward, so two forwards double the gathering (2 CPU processes on the tiny model: a ZeRO-3 training test took
    107 s instead of 100 s); whether the compute saved outweighs it on GPUs is not measured."""
    if zero3 or prompt_length < 2 or any(value is not None and value is not False for value in extra_inputs.values()):
        return False
    checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not (checkpointing and model.training)


def logps_and_entropies(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities and entropies of the last ``logits_to_keep`` tokens of each row, as TRL's
    per-token scoring computes them with one whole-row forward (called from the trainer's override of it,
    ``grpo_steps.training.trainer``).

    Args:
        model: the policy or reference model as TRL calls it (DeepSpeed engine, DDP, PEFT or plain), carrying TRL's
            fused LM head (``add_fused_lm_head``; TRL adds it in the trainer's constructor).
        input_ids: (B, P + C) long, left-padded prompts then right-padded completions.
        attention_mask: (B, P + C), 1 on real tokens.
        logits_to_keep: C.

    Returns:
        ``(logps, entropies)``, each (B, C) float32, 0 where the completion is padding; ``entropies`` None when the
        fused head was added without them.

    Raises:
        RuntimeError: the model returned no KV cache for the prompts (a model without one; see :func:`applies`).
    """
    prompt_length = input_ids.size(1) - logits_to_keep
    prefix_ids, prefix_mask = input_ids[:, :prompt_length - 1], attention_mask[:, :prompt_length - 1]
    # rows with the same prompt tokens and padding share one forward; `rows` maps each row to its distinct prompt
    distinct, rows = torch.unique(torch.cat([prefix_ids, prefix_mask.to(prefix_ids.dtype)], dim=1), dim=0,
                                  return_inverse=True)
    width = prefix_ids.size(1)
    # logits_to_keep=1: the prompt pass needs the cache, not the logits of its positions
    cache = model(input_ids=distinct[:, :width], attention_mask=distinct[:, width:], use_cache=True,
                  logits_to_keep=1).past_key_values
    if cache is None or cache.get_seq_length() != width:
        raise RuntimeError(f"{type(model).__name__} kept no KV cache of the prompts ({width} tokens): score the "
                           "batch with one whole-row forward (grpo_steps.training.shared_prefix.applies)")
    # the tokens whose hidden states predict the completion: the last prompt token and all but the last completion
    # token; their labels are the completion tokens, -100 (not scored) on padding, as TRL masks them
    labels = input_ids[:, prompt_length:].masked_fill(attention_mask[:, prompt_length:] == 0, -100)
    # each row's completion length: its last attended position (right padding)
    positions = torch.arange(1, logits_to_keep + 1, device=attention_mask.device)
    groups = length_groups((attention_mask[:, prompt_length:] * positions).amax(dim=1))
    logps = entropies = None
    for index, (members, length) in enumerate(groups):
        # (U, ...) -> (rows, ...): a differentiable index_select per layer; in place for the last group
        rows_cache = cache if index == len(groups) - 1 else _copy_of_layers(cache)
        rows_cache.reorder_cache(rows[members])
        outputs = model(input_ids=input_ids[members, prompt_length - 1:prompt_length - 1 + length],
                        attention_mask=attention_mask[members, :prompt_length - 1 + length],
                        past_key_values=rows_cache, shift_labels=labels[members, :length], fused_lm_head=True)
        if len(groups) == 1 and length == logits_to_keep:
            return outputs.log_probs, outputs.entropy
        if logps is None:
            logps = outputs.log_probs.new_zeros((input_ids.size(0), logits_to_keep))
            entropies = None if outputs.entropy is None else torch.zeros_like(logps)
        logps[members, :length] = outputs.log_probs  # index_put: differentiable, 0 past a group's length (padding)
        if entropies is not None:
            entropies[members, :length] = outputs.entropy
    return logps, entropies


MIN_PADDING_SAVED = 0.25
"""The share of the padded completion positions a second group must save (:func:`length_groups`): it pays for a
second forward through every layer and a second copy of the prompts' cache."""


def length_groups(lengths: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The rows of a batch grouped for the completion forward, each group padded to its longest completion: one
    group, or two (the shorter rows up to some length ``L``, then the rest) when that cuts the padded positions
    (rows x length) by :data:`MIN_PADDING_SAVED` or more. A GRPO batch pads every completion to the longest one: early
    in a run one completion of 16 that runs to the token limit (48 in ``make run``) while the others stop after ~6
    made every row 48 positions long in the forward and the backward.

    Args:
        lengths: (B,) tokens of each row's completion (right padding: its last attended position).

    Returns:
        ``[(row indices, length), ...]``, the rows in ascending length order, the group of the longest rows last.
    """
    order = torch.argsort(lengths, stable=True)
    ordered = [max(int(n), 1) for n in lengths[order].tolist()]
    rows, longest = len(ordered), ordered[-1]
    whole = rows * longest
    best, split = whole, None
    for cut in range(1, rows):  # rows order[:cut] form the short group, padded to the longest of them
        cost = cut * ordered[cut - 1] + (rows - cut) * longest
        if cost < best:
            best, split = cost, cut
    if split is None or best > (1 - MIN_PADDING_SAVED) * whole:
        return [(torch.arange(rows, device=lengths.device), longest)]
    return [(order[:split], ordered[split - 1]), (order[split:], longest)]


def _copy_of_layers(cache):
    """A cache whose layer objects are copies of ``cache``'s, sharing their tensors: ``Cache.reorder_cache`` replaces
    each layer's key and value tensors, so a group's expansion leaves the prompts' cache to the next group."""
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in cache.layers]
    return view


def chunked_logps_and_entropies(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                                batch_size: int | None, compute_entropy: bool
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logps_and_entropies` of ``input_ids`` (B, P + C) in TRL's chunks of ``batch_size`` rows (None: one
    chunk), scored one after the other as TRL's per-token scoring does: ``(logps (B, C), entropies (B, C) or None
    without compute_entropy)``."""
    batch_size = batch_size or input_ids.size(0)
    scored = [logps_and_entropies(model, input_ids[start:start + batch_size], attention_mask[start:start + batch_size],
                                  logits_to_keep)
              for start in range(0, input_ids.size(0), batch_size)]
    entropies = torch.cat([e for _, e in scored]) if compute_entropy else None
    return torch.cat([logps for logps, _ in scored]), entropies
