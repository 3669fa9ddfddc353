import itertools
import math

import pytest

from grpo_steps.evaluation.stats import paired_gain, pass_at_k


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c correct) that hold at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


ALL_SMALL = [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)]


@pytest.mark.parametrize(("n", "c", "k"), ALL_SMALL)
def test_pass_at_k_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k))


def test_pass_at_1_is_the_share_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


T1, T3 = 12.7062047362, 3.18244630528  # Student's t(0.975) with 1 and 3 degrees of freedom


@pytest.mark.parametrize(("before", "after", "gain", "half_width"), [
    ([0.0] * 4, [1.0] * 4, 1.0, T3 * math.sqrt(0.2) / 2),  # every prompt gains 1: sd of 1,1,1,1 plus a 0, never 0
    ([1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0], 0.0, 0.0),  # the same answers: no gain
    ([0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0], 0.5, T3 * math.sqrt(1 / 3) / 2),  # d = 1,0,0,1: sd sqrt(1/3)
    ([1.0, 1.0], [0.0, 0.0], -1.0, T1 * math.sqrt(1 / 3) / math.sqrt(2)),  # a loss is negative; two prompts: wide
])
def test_paired_gain(before, after, gain, half_width):
    assert paired_gain(before, after) == pytest.approx((gain, half_width))


def test_paired_gain_width_shrinks_with_more_prompts():
    # the same mix of per-prompt differences over 4x the prompts: sd sqrt(4/15), over sqrt(16)
    large = paired_gain([0.0, 0.0, 1.0, 0.0] * 4, [1.0, 0.0, 1.0, 1.0] * 4)[1]
    assert large == pytest.approx(2.13144954556 * math.sqrt(4 / 15) / 4)  # t(0.975, 15)
    assert large < paired_gain([0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0])[1] / 2


def test_paired_gain_one_prompt_has_no_width_and_mismatched_lists_fail():
    gain, width = paired_gain([0.0], [1.0])
    assert gain == 1.0 and math.isnan(width)
    with pytest.raises(ValueError, match="equally long"):
        paired_gain([0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_gain([], [])


def test_an_earlier_evaluation_of_other_prompts_is_not_taken_as_the_baseline(capsys):
    """An evaluation made during training (the step-0 one, the last step's) is the baseline or the trained policy's
    only for the same prompts, in the same order; nothing is asked of the server (client None) before that is known."""
    from grpo_steps.config import REPO_ROOT, load_config
    from grpo_steps.evaluation.comparison import same_weights_as
    from grpo_steps.evaluation.stats import prompt_key

    cfg = load_config(REPO_ROOT / "configs" / "test.yaml")
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1?"}]} for i in range(3)]
    earlier = {"prompt_keys": [prompt_key(row["prompt"]) for row in reversed(rows)], "probe_logprobs": [-0.1],
               "step": 0}
    assert not same_weights_as(cfg, None, None, rows, None, "baseline")
    assert not same_weights_as(cfg, None, None, rows, earlier, "baseline")
    assert not same_weights_as(cfg, None, None, rows[:2], {**earlier, "prompt_keys": earlier["prompt_keys"][1:]},
                               "baseline")
    assert "[eval baseline] the evaluation at training step 0 has other prompts: measuring the baseline policy" \
        in capsys.readouterr().out
    assert not same_weights_as(cfg, None, None, rows, {**earlier, "step": 30}, "trained")
    assert "[eval trained] the evaluation at training step 30 has other prompts" in capsys.readouterr().out


def test_training_evaluations_are_those_this_attempt_made(tmp_path):
    import json

    from grpo_steps.steps import training_evaluations
    from grpo_steps.training.job import SPLIT_RESULTS

    # a resumed attempt that began past step 0 and whose last step is no multiple of eval.every_steps, or no
    # evaluation during training: evaluate measures both
    assert training_evaluations(str(tmp_path)) == {}
    trained = {"metrics": {"accuracy": 0.5}, "prompt_keys": ["k"], "step": 30}
    (tmp_path / SPLIT_RESULTS["trained"]).write_text(json.dumps(trained))
    assert training_evaluations(str(tmp_path)) == {"trained": trained}
    baseline = {**trained, "step": 0}
    (tmp_path / SPLIT_RESULTS["baseline"]).write_text(json.dumps(baseline))
    assert training_evaluations(str(tmp_path)) == {"baseline": baseline, "trained": trained}
