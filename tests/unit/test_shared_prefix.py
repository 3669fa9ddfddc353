"""Each distinct prompt forwarded once (``grpo_steps.training.shared_prefix``) against TRL's whole-row forward, on the
same trainer and batch: the same log-probabilities, entropies and gradients, with fewer tokens through the model;
TRL's forward where sharing cannot apply. The tiny policy; no server."""

import contextlib

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import PipelineGRPOTrainer

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def trainer(tiny_model_path, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    cfg = validate_config({"train": {"per_device_train_batch_size": 6, "num_generations": 3,
                                     "grpo": {"gradient_checkpointing": False}}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused",
                              output_dir=str(tmp_path_factory.mktemp("shared-prefix"))))
    return PipelineGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                               reward_funcs=[lambda completions, **_: [0.0] * len(completions)] * 2, args=args,
                               train_dataset=Dataset.from_list([{"prompt": "1 + 1"}] * 6),
                               processing_class=AutoTokenizer.from_pretrained(tiny_model_path))


def batch(prompts: list[list[int]], completions: list[list[int]], pad: int = 0):
    """Rows as TRL builds them: each prompt left-padded, each completion right-padded; (B, P + C) ids and mask."""
    width, length = max(map(len, prompts)), max(map(len, completions))
    ids = [[pad] * (width - len(p)) + p + c + [pad] * (length - len(c))
           for p, c in zip(prompts, completions, strict=True)]
    mask = [[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c))
            for p, c in zip(prompts, completions, strict=True)]
    return torch.tensor(ids), torch.tensor(mask), length


@contextlib.contextmanager
def tokens_through_model(model):
    """Yields a list that records the size (rows x tokens) of every forward of the model's transformer body."""
    sizes = []
    hook = model.get_decoder().register_forward_hook(
        lambda module, args, kwargs, output: sizes.append(kwargs["input_ids"].numel()), with_kwargs=True)
    try:
        yield sizes
    finally:
        hook.remove()


def scores_and_gradients(trainer, score, ids, mask, keep):
    """``score``'s (logps, entropies) of the rows and the gradient of the sum of the logps over the completion."""
    trainer.model.zero_grad()
    logps, entropies, _ = score(trainer.model, ids, mask, keep, compute_entropy=True)
    (logps * mask[:, -keep:]).sum().backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return logps.detach(), entropies.detach(), grads


def test_one_forward_per_distinct_prompt_gives_trls_logps_entropies_and_gradients(trainer):
    # two prompts of different lengths (left padding), three completions each of different lengths (right padding),
    # in the order TRL's shuffle may leave them
    first, second = [11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24]
    prompts = [first, second, first, second, first, second]
    completions = [[31, 32, 33], [41], [51, 52, 53, 54, 55], [61, 62], [71], [81, 82, 83, 84]]
    ids, mask, keep = batch(prompts, completions)
    trainer.model.train()
    with tokens_through_model(trainer.model) as sizes:
        ours = scores_and_gradients(trainer, trainer._get_per_token_logps_and_entropies, ids, mask, keep)
        shared_tokens, sizes[:] = sum(sizes), []
        trls = scores_and_gradients(trainer, lambda *a, **k: trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, *a, **k), ids, mask, keep)

    assert sizes == [6 * 12]  # TRL: every row whole, 7 + 5 tokens each
    # the 2 prompts' first 6 tokens once, then the completions (lengths 1, 1, 2 | 3, 4, 5) in two groups: 3 rows of 2
    # tokens, 3 rows of 5 (one group: 6 rows of 5)
    assert shared_tokens == 2 * 6 + 3 * 2 + 3 * 5
    torch.testing.assert_close(ours[0], trls[0], atol=1e-5, rtol=1e-5)
    assert bool((ours[0][mask[:, -keep:] == 0] == 0).all())  # padding scores 0, as TRL's
    torch.testing.assert_close(ours[1], trls[1], atol=1e-5, rtol=1e-5)
    assert ours[2].keys() == trls[2].keys() and len(ours[2]) > 10
    for name, grad in trls[2].items():
        torch.testing.assert_close(ours[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # the check can fail: one completion token changed moves its row's logps
    changed = ids.clone()
    changed[0, -keep + 1] += 1
    assert not torch.allclose(trainer._get_per_token_logps_and_entropies(trainer.model, changed, mask, keep)[0],
                              ours[0], atol=1e-3)


def test_trls_chunks_and_distinct_prompts_give_trls_logps(trainer):
    """TRL's scoring pass cuts the generation batch into chunks of ``batch_size`` rows; rows without a shared prompt
    still go through the two parts."""
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32], [41, 42, 43]]
    ids, mask, keep = batch(prompts, [[5, 6], [7], [8, 9, 10], [11]])
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, batch_size=3)[0]
        trls = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, keep,
                                                                  batch_size=3)[0]
    torch.testing.assert_close(ours, trls, atol=1e-5, rtol=1e-5)


def test_trls_forward_where_the_prompt_cannot_be_shared(trainer):
    """Gradient checkpointing in training mode drops the KV cache in transformers' layers, a one-token prompt has no
    prefix to share: TRL's whole-row forward."""
    ids, mask, keep = batch([[11, 12, 13]] * 2, [[5, 6], [7, 8]])
    with tokens_through_model(trainer.model) as sizes:
        trainer.model.gradient_checkpointing_enable()
        try:
            trainer.model.train()
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
            assert sizes == [2 * 5]
            trainer.model.eval()  # checkpointing only acts in training mode: shared
            sizes[:] = []
            with torch.no_grad():
                trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
            assert sizes == [1 * 2, 2 * 2]
        finally:
            trainer.model.gradient_checkpointing_disable()
            trainer.model.train()
        sizes[:] = []
        one, one_mask, one_keep = batch([[11]] * 2, [[5, 6], [7, 8]])
        trainer._get_per_token_logps_and_entropies(trainer.model, one, one_mask, one_keep)
        assert sizes == [2 * 3]


def test_not_under_zero3_where_each_forward_gathers_the_weights_again(trainer):
    from grpo_steps.training import shared_prefix

    trainer.model.train()
    assert shared_prefix.applies(trainer.model, 7, {"pixel_values": None, "compute_aux_loss": False})
    assert not shared_prefix.applies(trainer.model, 7, {}, zero3=True)
    assert not shared_prefix.applies(trainer.model, 7, {"pixel_values": torch.zeros(1)})  # multimodal
    assert not shared_prefix.applies(trainer.model, 7, {"compute_aux_loss": True})  # a MoE model's auxiliary loss


def test_completions_are_grouped_by_length_when_it_saves_a_quarter_of_the_padding():
    from grpo_steps.training.shared_prefix import length_groups

    def groups(lengths):
        return [(sorted(rows.tolist()), length) for rows, length in length_groups(torch.tensor(lengths))]

    # make run's early steps: one completion of 16 ran to the 48-token limit, the others stopped after ~6
    assert groups([6, 48, 5, 7] + [6] * 12) == [([0, *range(2, 16)], 7), ([1], 48)]
    assert groups([5, 6, 7, 6]) == [([0, 1, 2, 3], 7)]  # alike: one group, one forward
    assert groups([10, 12, 8, 9]) == [([0, 1, 2, 3], 12)]  # two groups would save 2 of 48 positions
    assert groups([0, 0]) == [([0, 1], 1)]


def test_two_length_groups_give_trls_logps_entropies_and_gradients(trainer):
    """One long completion among short ones (the rows scored in two groups, one of them on a copy of the prompts'
    cache): TRL's numbers, and the short rows forwarded at their own length."""
    prompt = [11, 12, 13, 14, 15]
    completions = [[31, 32], [41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [51], [61, 62]]
    ids, mask, keep = batch([prompt] * 4, completions)
    trainer.model.train()
    with tokens_through_model(trainer.model) as sizes:
        ours = scores_and_gradients(trainer, trainer._get_per_token_logps_and_entropies, ids, mask, keep)
    assert sizes == [1 * 4, 3 * 2, 1 * 10]
    trls = scores_and_gradients(trainer, lambda *a, **k: trl.GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, *a, **k), ids, mask, keep)
    torch.testing.assert_close(ours[0], trls[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1] * mask[:, -keep:], trls[1] * mask[:, -keep:], atol=1e-5, rtol=1e-5)
    for name, grad in trls[2].items():
        torch.testing.assert_close(ours[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)
