"""The mismatch correction weighed in the loss's own forward (``grpo_steps.training.correction``) against TRL's own
path on the same batches: a trainer that skips TRL's scoring pass and one that runs it (``loss_side_correction``
None) get identical generation batches from a stand-in for the server (fixed completions and sampler logprobs, so
that both sample the same), and must give the same importance weights, loss, gradients and ``sampling/*`` metrics,
with one policy forward per micro-batch fewer, and the same mismatch per replica. The tiny policy; no server."""

import copy

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.dev.stand_in_server import StandInServer
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.server import ServerSettings
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import ServerGRPOTrainer

SAMPLING = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max"]
REPLICAS = [f"sampling/replica{i}/sampling_logp_difference/mean" for i in (0, 1)]
PROMPTS = [{"prompt": f"{a} + {a}"} for a in range(8)]


class FixedSampler(StandInServer):
    """Stands in for the generation server: the same completions for the same prompts every call, with sampler
    logprobs that are the initial policy's (a copy: its forwards are not counted) plus seeded noise of 0.4 nats, one
    of them NaN (a token vLLM could not score), so that two trainers sample identical batches whose weights differ
    from token to token; the groups are "sampled" by two replicas in turn (the per-replica mismatch)."""

    def __init__(self, settings, policy):
        super().__init__(settings)
        self.policy = policy
        self.replicas: dict[tuple, int] = {}

    def replica_of(self, prompt):
        return self.replicas.setdefault(tuple(prompt), len(self.replicas) % 2)  # two "replicas", in turn per group

    def sample(self, prompt, index):
        rng = torch.Generator().manual_seed(sum(prompt) * 31 + index)
        completion = [int(t) for t in torch.randint(5, 90, (2 + index % 5,), generator=rng)]
        with torch.no_grad():
            logits = self.policy(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        lps = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        lps = (lps + 0.4 * torch.randn(len(completion), generator=rng, dtype=torch.float64)).tolist()
        if index == 1:
            lps[0] = float("nan")
        return completion, lps


def trainer(tiny_model_path, tmp_path, mode: str, accumulation: int, loss_side: bool) -> ServerGRPOTrainer:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    cfg = validate_config({"generation": {"importance_sampling": {"mode": mode, "clip_min": 0.5, "clip_max": 3.0},
                                          "max_completion_tokens": 8},
                           "train": {"per_device_train_batch_size": 4, "num_generations": 2,
                                     "gradient_accumulation_steps": accumulation}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused", output_dir=str(tmp_path)))
    client = VLLMClient("http://127.0.0.1:9", replicas=("http://127.0.0.1:9", "http://127.0.0.1:10"))
    server = ServerSettings(client=client, gen=cfg.generation,
                            max_model_len=256, transport=None, probe_ids=[1, 2], probe_tolerance=0.05)  # never called
    length = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731  (signal in every group)
    out = ServerGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path), reward_funcs=[length, length],
                            args=args, train_dataset=Dataset.from_list(PROMPTS),
                            processing_class=AutoTokenizer.from_pretrained(tiny_model_path), server=server)
    out.vllm_generation = FixedSampler(out.vllm_generation.settings, copy.deepcopy(out.model).eval())
    if not loss_side:
        out.loss_side_correction = None  # TRL's own scoring pass
    out.model.train()
    out.current_gradient_accumulation_steps = accumulation  # set by Trainer.training_step in a real step
    return out


def one_generation_batch(trainer: ServerGRPOTrainer, accumulation: int) -> tuple[list[dict], list[float], int]:
    """Generate once and train on each micro-batch (forward, backward): the micro-batches with their weights, the
    losses, and the rows the policy scored (a row scored twice counts twice)."""
    from grpo_steps import trl_hooks

    # rows scored: those of the forwards through TRL's fused LM head (not the prompts' shared pass; the completions
    # of one scoring may go in two length groups, grpo_steps.training.shared_prefix.length_groups)
    scored = []
    hook = trainer.model.register_forward_hook(
        lambda module, args, kwargs, output: scored.append(len(kwargs["input_ids"])) if kwargs.get("fused_lm_head")
        else None, with_kwargs=True)
    batches, losses = [], []
    rows = PROMPTS[:4 * accumulation]
    torch.manual_seed(1)  # TRL shuffles the generation batch before cutting it
    for _ in range(accumulation):
        batch = trainer._prepare_inputs(rows)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        batches.append(batch)
        losses.append(loss.item())
        trl_hooks.count_micro_step(trainer)
    hook.remove()
    return batches, losses, sum(scored)


@pytest.mark.parametrize(("mode", "accumulation"), [("token_truncate", 2), ("sequence_mask", 1)])
def test_the_loss_side_correction_is_trls(tiny_model_path, tmp_path, mode, accumulation):
    trls = trainer(tiny_model_path, tmp_path / "trl", mode, accumulation, loss_side=False)
    ours = trainer(tiny_model_path, tmp_path / "ours", mode, accumulation, loss_side=True)
    assert ours.loss_side_correction is not None
    trl_batches, trl_losses, trl_scored = one_generation_batch(trls, accumulation)
    our_batches, our_losses, our_scored = one_generation_batch(ours, accumulation)

    rows = sum(len(batch["completion_ids"]) for batch in our_batches)
    assert our_scored == rows and trl_scored == 2 * rows  # TRL's scoring pass is gone: each row scored once
    for theirs, mine in zip(trl_batches, our_batches, strict=True):
        assert torch.equal(theirs["completion_ids"], mine["completion_ids"])  # the same rows, the same order
        assert "old_per_token_logps" in theirs and "old_per_token_logps" not in mine
        assert torch.allclose(mine["importance_sampling_ratio"], theirs["importance_sampling_ratio"], atol=1e-5)
    weights = torch.cat([b["importance_sampling_ratio"].flatten() for b in trl_batches])
    assert len(set(weights.tolist())) > 2  # the weights differ between tokens: a real comparison
    assert our_losses == pytest.approx(trl_losses, abs=1e-6)
    for (name, theirs), mine in zip(trls.model.named_parameters(), ours.model.parameters(), strict=True):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6), name
    for name in SAMPLING + REPLICAS:  # one value per generation batch, TRL's (per replica: from TRL's scoring pass)
        assert len(ours._metrics["train"][name]) == 1, name
        assert ours._metrics["train"][name] == pytest.approx(trls._metrics["train"][name], rel=1e-5, abs=1e-6), name
    # the token mean over both replicas' completions is TRL's overall mean (one process), and the replicas differ
    per_replica = [ours._metrics["train"][name][0] for name in REPLICAS]
    overall = ours._metrics["train"]["sampling/sampling_logp_difference/mean"][0]
    assert min(per_replica) < overall < max(per_replica), (per_replica, overall)


@pytest.mark.parametrize("change", [{"train": {"grpo": {"num_iterations": 2}}},
                                    {"train": {"grpo": {"steps_per_generation": 2}}},
                                    {"train": {"zero_signal_groups": "skip"}},
                                    {"train": {"zero_signal_groups": "replay"}},
                                    {"generation": {"importance_sampling": {"mode": "off"}}}],
                         ids=["two-iterations", "generation-across-steps", "skip", "replay", "correction-off"])
def test_trls_scoring_pass_stays_where_the_loss_cannot_replace_it(tmp_path, change):
    """Two iterations per batch (the second trains on weights the batch was not sampled by), a generation batch
    trained across two optimizer steps, a zero-signal mode whose micro-batches do not all reach the loss or that
    re-weighs replayed rows, or no correction: TRL's own path. What the trainer reads, from the GRPOConfig and the
    zero-signal mode a config becomes."""
    from types import SimpleNamespace

    from grpo_steps.training.correction import applies
    from grpo_steps.training.zero_signal import mode_for

    def reads(overrides: dict) -> SimpleNamespace:
        cfg = validate_config({**overrides, "train": {"per_device_train_batch_size": 2, "num_generations": 2,
                                                      **overrides.get("train", {})}})
        args = grpo_args(TrainJob(config=cfg, model_path="m", train_file="t", output_dir=str(tmp_path)))
        return SimpleNamespace(args=args, num_iterations=args.num_iterations, zero_signal=mode_for(cfg.train),
                               vllm_importance_sampling_correction=args.vllm_importance_sampling_correction)

    assert applies(reads({}))  # the default: one iteration, a generation batch per optimizer step, keep
    assert applies(reads({"train": {"zero_signal_groups": "resample"}}))
    assert not applies(reads(change))


def test_the_sampler_logprobs_go_on_the_policys_support_token_by_token(tiny_model_path):
    """``on_policy_support`` adds log pi_T(y) - log q_pi(y) to each policy token's sampler logprob, computed by hand
    here from the policy's logits with top-k 3 at temperature 0.7 (log of the mass the top 3 keep); tool-answer
    tokens (tool_mask 0) and tokens vLLM could not score (None) are left as they are."""
    from transformers import AutoModelForCausalLM

    from grpo_steps.config import GenerationConfig
    from grpo_steps.training.correction import on_policy_support

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    gen = GenerationConfig(temperature=0.7, top_k=3)
    prompt, completion = [1, 5, 9, 13], [4, 8, 2, 7, 6]
    tool_mask = [1, 1, 0, 0, 1]
    sampler = [-0.5, None, 0.0, 0.0, -1.25]
    (shifted, other), shifts = on_policy_support(model, gen, [prompt, prompt], [completion, []], [tool_mask, []],
                                                 [sampler, []], group=2)
    assert other == []  # an empty completion (a prompt that filled the context) in the group
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1] / 0.7  # (C, V)
    full = logits.log_softmax(-1)
    top3 = logits.topk(3, dim=-1)
    by_hand = []
    for t, token in enumerate(completion):
        kept = torch.full_like(logits[t], float("-inf")).scatter(0, top3.indices[t], top3.values[t])
        if kept[token] == float("-inf"):  # the sampled token outside the policy's top 3 keeps its logit
            kept[token] = logits[t, token]
        by_hand.append(float(full[t, token] - kept.log_softmax(-1)[token]))
    assert shifted[0] == pytest.approx(-0.5 + by_hand[0], abs=1e-5)
    assert shifted[1] is None and shifted[2:4] == [0.0, 0.0]
    assert shifted[4] == pytest.approx(-1.25 + by_hand[4], abs=1e-5)
    assert shifts == pytest.approx([by_hand[0], by_hand[4]], abs=1e-5)
    assert all(s < 0 for s in shifts)  # top-k keeps less than the whole mass
    with pytest.raises(ValueError, match="not one group of 2 completions of one prompt"):
        on_policy_support(model, gen, [prompt, prompt[:2]], [completion, completion], None, [sampler, sampler], 2)
