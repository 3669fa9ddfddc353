import pytest

from rewards.reward_model import load_reward_model, reward_model, reward_text


@pytest.fixture(scope="module")
def tiny_rm_path(tiny_model_path, tmp_path_factory):
    """A random Qwen2 sequence classifier (2 labels) with the tiny policy's tokenizer, saved locally."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tiny-rm")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


PROMPTS = ["What is 2+2?", "Name a color.", "Say hi.", "2*3?"]
COMPLETIONS = ["4", "A long answer that goes on and on about the color blue and why it is nice.", "hi", "Answer: 6"]


def test_scores_are_one_logit_per_completion_and_deterministic(tiny_rm_path):
    first = reward_model(COMPLETIONS, PROMPTS, model=tiny_rm_path)
    assert len(first) == 4 and all(isinstance(s, float) for s in first)
    assert reward_model(COMPLETIONS, PROMPTS, model=tiny_rm_path) == first
    assert len(set(first)) > 1  # different texts, different scores


@pytest.mark.parametrize("batch_size", [1, 3, 8])  # one per batch, a ragged last batch, all in one (padding)
def test_batching_and_padding_do_not_change_scores(tiny_rm_path, batch_size):
    alone = [reward_model([c], [p], model=tiny_rm_path)[0] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert reward_model(COMPLETIONS, PROMPTS, model=tiny_rm_path, batch_size=batch_size) == pytest.approx(
        alone, abs=1e-4)


def test_label_index_picks_the_logit_and_is_checked(tiny_rm_path):
    label0 = reward_model(COMPLETIONS, PROMPTS, model=tiny_rm_path)
    label1 = reward_model(COMPLETIONS, PROMPTS, model=tiny_rm_path, label_index=1)
    assert label0 != label1
    with pytest.raises(IndexError, match="2 labels"):
        reward_model(COMPLETIONS, PROMPTS, model=tiny_rm_path, label_index=2)


def test_conversational_inputs_go_through_the_chat_template_and_the_model_loads_once(tiny_rm_path):
    _, tokenizer = load_reward_model(tiny_rm_path, "cpu")
    prompt = [{"role": "user", "content": "What is 2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    text = reward_text(prompt, completion, tokenizer)
    if tokenizer.chat_template:
        assert text == tokenizer.apply_chat_template([*prompt, *completion], tokenize=False)
    hits = load_reward_model.cache_info().hits
    # a plain-text prompt and completion become the same two messages
    assert reward_model([completion], [prompt], model=tiny_rm_path) == reward_model(
        ["4"], ["What is 2+2?"], model=tiny_rm_path)
    assert load_reward_model.cache_info().hits == hits + 2


def test_empty_batch_and_missing_prompts(tiny_rm_path):
    assert reward_model([], model=tiny_rm_path) == []
    assert len(reward_model(["4", "5"], None, model=tiny_rm_path)) == 2  # no prompts: completions alone


ADVERSARIAL = [
    # (prompt, completion)
    ("What is 2+2?", ""),  # empty completion
    ("", "4"),  # empty prompt
    ("Translate: chat", "猫 🐈 — Katze, ¿gato?"),  # unicode and emoji
    ("Sum?", "Answer: 3\nAnswer: 4\n\\boxed{5}"),  # several answers
    ("Big?", "9" * 500),  # huge number, many tokens
    ("Tags?", "<think><think>x</think></think><answer>1</answer>"),  # nested tags
    ("Long?", "word " * 3000),  # longer than max_length: truncated, still one score
    ([{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "Hello"}]),  # conversational
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "Hello"),  # system + text
    ("Null bytes?", "a\x00b"),  # control characters
]


@pytest.mark.parametrize(("prompt", "completion"), ADVERSARIAL)
def test_adversarial_inputs_get_one_finite_score_each_independent_of_the_batch(tiny_rm_path, prompt, completion):
    import math

    alone = reward_model([completion], [prompt], model=tiny_rm_path, max_length=256)
    assert len(alone) == 1 and math.isfinite(alone[0])
    batch = reward_model([completion, "4"], [prompt, "What is 2+2?"], model=tiny_rm_path, max_length=256)
    assert batch[0] == pytest.approx(alone[0], abs=1e-4)  # padding next to a short sequence changes nothing
