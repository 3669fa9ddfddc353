"""``generation.structured_outputs`` re-applied on the policy's logits (``grpo_steps.training.grammar``): the tokens the
grammar allows at each position of each policy turn, and the correction's shift they give, computed by hand here on
the tiny policy. That the mask allows what a real vLLM server allowed is tests/integration/test_generation_contract.py
(the ratio of a training step under a grammar is 1)."""

import pytest
import torch

from grpo_steps.config import GenerationConfig

REGEX = "[0-9]{1,2} (apples|pears)"


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def _allowed(bitmask: torch.Tensor, vocab: int) -> list[set[int]]:
    """The token ids each row of an xgrammar bitmask (C, ceil(V / 32)) int32 allows."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # (C, W, 32), bit j of word w
    return [set(torch.nonzero(row.reshape(-1)[:vocab]).flatten().tolist()) for row in bits]


def test_each_turn_is_walked_from_the_grammars_start_and_ends_on_a_stop_token(tiny):
    from grpo_steps.training.grammar import GrammarMask

    model, tokenizer = tiny
    vocab = model.config.vocab_size
    mask = GrammarMask(tokenizer, vocab, GenerationConfig(structured_outputs={"regex": REGEX}),
                           model.generation_config)
    assert mask.stop_ids == [tokenizer.eos_token_id]
    turn = tokenizer.encode("12 apples", add_special_tokens=False) + [tokenizer.eos_token_id]
    tool = tokenizer.encode(" tool says 24", add_special_tokens=False)
    completion = turn + tool + turn
    own = [1] * len(turn) + [0] * len(tool) + [1] * len(turn)
    allowed = _allowed(mask.bitmask(completion, own), vocab)
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert allowed[0] == digits  # a number first: one of the digit tokens, nothing else
    space_a = tokenizer.encode(" a", add_special_tokens=False)[0]
    assert tokenizer.eos_token_id not in allowed[1] and space_a in allowed[2]
    assert allowed[len(turn) - 1] == {tokenizer.eos_token_id}  # "12 apples" is whole: only the stop token
    assert all(allowed[t] == set(range(vocab)) for t in range(len(turn), len(turn) + len(tool)))  # the tool's answer
    assert allowed[len(turn) + len(tool):] == allowed[:len(turn)]  # the next turn starts the grammar again
    assert mask.diverged == 0
    # a token the grammar does not allow (a letter first: another backend's choice): the rest of the turn is free
    off = tokenizer.encode("x1", add_special_tokens=False)
    allowed = _allowed(mask.bitmask(off, [1] * len(off)), vocab)
    assert mask.diverged == 1 and all(a == set(range(vocab)) for a in allowed)


def test_the_shift_is_the_log_of_the_mass_the_grammar_allows(tiny):
    """Sampler logprob plus shift is the policy's own logprob where the grammar forces the token (one allowed: the
    sampler's logprob is 0), and the log mass of the allowed tokens is subtracted where it chooses among several."""
    from grpo_steps.training.correction import on_policy_support
    from grpo_steps.training.grammar import GrammarMask

    model, tokenizer = tiny
    gen = GenerationConfig(temperature=0.7, structured_outputs={"regex": REGEX})
    mask = GrammarMask(tokenizer, model.config.vocab_size, gen, model.generation_config)
    prompt = tokenizer.encode("How many?", add_special_tokens=False)
    completion = tokenizer.encode("12 apples", add_special_tokens=False) + [tokenizer.eos_token_id]
    sampler = [-1.0] * len(completion)
    (shifted,), shifts = on_policy_support(model, gen, [prompt], [completion], None, [sampler], 1, mask)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1] / 0.7  # (C, V)
    allowed = _allowed(mask.bitmask(completion, [1] * len(completion)), model.config.vocab_size)
    by_hand = [float(logits[t].log_softmax(-1)[token] - logits[t].masked_fill(
        ~torch.isin(torch.arange(logits.size(-1)), torch.tensor(sorted(allowed[t]))), float("-inf")
    ).log_softmax(-1)[token]) for t, token in enumerate(completion)]
    assert shifts == pytest.approx(by_hand, abs=1e-5) and shifted == pytest.approx([-1.0 + d for d in by_hand])
    forced = [t for t in range(len(completion)) if len(allowed[t]) == 1]
    assert forced and all(by_hand[t] == pytest.approx(float(logits[t].log_softmax(-1)[completion[t]]), abs=1e-5)
                          for t in forced)  # the whole policy logprob: the grammar left it no choice
    assert all(s < 0 for s in shifts)
