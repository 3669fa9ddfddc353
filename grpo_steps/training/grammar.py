"""The grammar of ``generation.structured_outputs`` re-applied on the policy's logits, as vLLM applies it.

vLLM samples each turn under the grammar: before its sampler, the logits of every token the grammar does not allow
next are set to -inf (vLLM 0.32, ``vllm/v1/structured_output``: xgrammar's matcher fills a token bitmask per
position), so the logprob it returns is renormalised over the allowed tokens. The policy scored by TRL sees the whole
vocabulary, so the mismatch correction's ratio pi_policy / pi_sampler carried the allowed mass of every token: on
``configs/game.yaml`` (a regex forcing each move's call) its mean was 1.5e-5 at step 1 and the gradient norm 2e-5,
so nothing trained (2026-12-06). :class:`GrammarMask` walks each policy turn of a completion through the same
grammar (xgrammar, compiled as vLLM's xgrammar backend compiles it: the same tokenizer info, vocabulary size and stop
tokens) and gives the (C, V) bitmask of the tokens allowed at each position, which
:func:`grpo_steps.training.sampling.support_shifts` applies before the sampling filters, as vLLM does.

xgrammar is vLLM's own dependency (installed with either stack's vLLM); it is imported only when a grammar is set.
A server whose structured-outputs backend is not xgrammar (vLLM's ``auto`` falls back to guidance for what xgrammar
cannot compile) may allow other tokens: a sampled token the mask does not allow ends the mask of that turn (its
remaining tokens are scored without the grammar) and is counted in :attr:`GrammarMask.diverged`.
"""

from __future__ import annotations

import json

import torch


def _grammar_spec(structured) -> tuple[str, str]:
    """``(kind, spec)`` of a :class:`grpo_steps.config.StructuredOutputsConfig`: ``regex``, ``json`` (the schema as
    JSON text) or ``grammar`` (a ``choice`` as vLLM writes it: ``root ::= "a" | "b"``, ``choice_as_grammar``)."""
    if structured.regex is not None:
        return "regex", structured.regex
    if structured.json_schema is not None:
        return "json", json.dumps(structured.json_schema)
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def literal(text: str) -> str:  # vLLM's escape_ebnf_string
        return "".join(escapes.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                       for ch in text)

    return "grammar", "root ::= " + " | ".join(f'"{literal(c)}"' for c in structured.choice)


def stop_token_ids(tokenizer, generation_config, gen) -> list[int]:
    """The tokens that end a sampled turn, which the grammar allows once it is complete: vLLM's
    ``SamplingParams.all_stop_token_ids`` (the tokenizer's EOS, the model's ``generation_config.eos_token_id`` and
    ``generation.stop_token_ids``)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return sorted(ids | set(gen.stop_token_ids or []))


class GrammarMask:
    """The grammar of ``gen.structured_outputs`` compiled once for the policy's tokenizer.

    Args:
        tokenizer: the policy's tokenizer (the server's: the same files).
        vocab_size: the policy's logits width V (vLLM's ``vocab_size``: the model config's, not the tokenizer's).
        gen: the :class:`grpo_steps.config.GenerationConfig` whose ``structured_outputs`` is set.
        generation_config: the model's ``GenerationConfig`` (its EOS ids end a turn as the tokenizer's do), or None.
    """

    def __init__(self, tokenizer, vocab_size: int, gen, generation_config=None) -> None:
        import xgrammar as xgr

        self._xgr, self.vocab_size = xgr, vocab_size
        self.stop_ids = stop_token_ids(tokenizer, generation_config, gen)
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
        kind, spec = _grammar_spec(gen.structured_outputs)
        compile_spec = {"regex": compiler.compile_regex, "grammar": compiler.compile_grammar,
                        "json": lambda s: compiler.compile_json_schema(s, any_whitespace=True)}[kind]
        self._compiled = compile_spec(spec)
        self.diverged = 0
        """Turns whose mask stopped at a sampled token the grammar did not allow (a server with another backend)."""

    def bitmask(self, completion_ids: list[int], own: list[int]) -> torch.Tensor:
        """(C, ceil(V / 32)) int32 bitmask (xgrammar's layout) of the tokens allowed at each position of a completion:
        each maximal run of ``own`` tokens (1: the policy's; a turn) walked from the grammar's start, the tools'
        answers (0) and the positions after a turn's grammar ended or diverged allowing every token."""
        xgr = self._xgr
        mask = xgr.allocate_token_bitmask(max(len(completion_ids), 1), self.vocab_size)  # all allowed
        matcher, live = None, False
        for t, (token, mine) in enumerate(zip(completion_ids, own, strict=True)):
            if not mine:
                matcher = None  # a tool answer: the next policy token starts a new turn, a new match
                continue
            if matcher is None:
                matcher = xgr.GrammarMatcher(self._compiled, override_stop_tokens=self.stop_ids)
                live = True
            if not live:
                continue
            matcher.fill_next_token_bitmask(mask, t)
            if not matcher.accept_token(token):
                xgr.reset_token_bitmask(mask[t:t + 1])  # this token unconstrained, and the rest of the turn
                self.diverged += 1
                live = False
            elif matcher.is_terminated():
                live = False
        return mask[: len(completion_ids)]

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """``logits`` (C, V) with every token the ``bitmask`` disallows at -inf (a copy), as vLLM masks them."""
        masked = logits.float().clone()
        self._xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), vocab_size=self.vocab_size)
        return masked
