"""Which weights a server serves, judged from probe logprobs and the pushed weights' fingerprints
(``grpo_steps.training.generation.push.served_version``), and the error that names the step and both versions."""

import pytest
import torch

from grpo_steps.training.generation.disk import GenerationServerError
from grpo_steps.training.generation.push import ProbeRecord, check_served_version, served_version
from grpo_steps.weights.files import weights_fingerprint

TOL = 0.05
W0, W1 = (1.0, 2.0), (1.001, 2.0)  # fingerprints of the pushed weights: one optimizer step apart
V0 = ProbeRecord(0, W0, served=[-1.000001, -2.000001], policy=[-1.0, -2.0])
V1_POLICY = [-1.00002, -2.00002]  # one optimizer step moved the policy by less than the tolerance

CASES = [
    # (served probe of the push of version 1, history, served version)
    ([-1.00002, -2.00002], [V0], 1),  # fresh weights, up to kernel noise
    ([-1.000001, -2.000001], [V0], 0),  # bit-for-bit the previous answer although the weights changed: stale
    ([-1.5, -2.5], [V0], None),  # neither version: other weights
    ([-1.00002, -2.00002], [], 1),  # first push: nothing to compare with but the policy
    ([-1.04, -2.04], [V0], 1),  # bf16-size noise, within the tolerance
]


@pytest.mark.parametrize(("served", "history", "expected"), CASES)
def test_served_version(served, history, expected):
    assert served_version(ProbeRecord(1, W1, served, V1_POLICY), history, TOL) == expected


def test_unchanged_weights_and_unchanged_server_is_not_stale():
    # no gradient in the step (e.g. every group scored alike): same weights, same answer
    assert served_version(ProbeRecord(1, W0, V0.served, V0.policy), [V0], TOL) == 1
    assert served_version(ProbeRecord(1, W0, V0.served), [V0], TOL) == 1


def test_weights_that_moved_too_little_to_change_the_policys_answer_are_not_stale():
    # a gradient of round-off size (identical completions scored differently): the weights differ in the last
    # digits, the policy's own answer does not, so the server's unchanged answer is the new version's
    tiny = ProbeRecord(1, (1.0000001, 2.0), served=list(V0.served), policy=[-1.0000002, -2.0000002])
    assert served_version(tiny, [V0], TOL) == 1
    assert served_version(ProbeRecord(1, tiny.weights, list(V0.served)), [V0], TOL) == 0  # no policy probe: stale


def test_without_a_policy_probe_an_earlier_answer_still_names_the_served_version():
    """The first-batch check compares the server with the policy; the probe still catches a server that serves an
    earlier push (the previous one, or one before it) and names it."""
    v1 = ProbeRecord(1, W1, served=[-1.1, -2.1])
    w2 = (1.002, 2.0)
    assert served_version(ProbeRecord(2, w2, [-1.2, -2.2]), [V0, v1], TOL) == 2  # new answer: the new version
    assert served_version(ProbeRecord(2, w2, list(v1.served)), [V0, v1], TOL) == 1
    assert served_version(ProbeRecord(2, w2, list(V0.served)), [V0, v1], TOL) == 0


def test_the_error_names_step_and_versions():
    with pytest.raises(GenerationServerError) as err:
        check_served_version(ProbeRecord(1, W1, V0.served, V1_POLICY), [V0], "step-1", TOL, step=2)
    assert "step 2:" in str(err.value)
    assert "expected version 1 (step-1), served version 0 (step-0)" in str(err.value)
    with pytest.raises(GenerationServerError, match="reports weight version 'default', expected 'step-1'"):
        check_served_version(ProbeRecord(1, W1, V1_POLICY, V1_POLICY), [V0], "default", TOL, step=2)
    check_served_version(ProbeRecord(1, W1, V1_POLICY, V1_POLICY), [V0], "step-1", TOL, step=2)  # passes
    with pytest.raises(GenerationServerError, match=r"expected version 1 \(step-1\), served version 0 \(step-0\)\."):
        check_served_version(ProbeRecord(1, W1, V0.served), [V0], "step-1", TOL, step=2)


def test_weights_fingerprint_tells_equal_from_updated_weights():
    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(1000, 64), "layer.weight": torch.randn(64, 64), "norm": torch.ones(64),
             "empty": torch.empty(0)}
    same = {k: v.clone() for k, v in state.items()}
    assert weights_fingerprint(same) == weights_fingerprint(state)
    assert len(weights_fingerprint(state)) == 3  # one sum per non-empty tensor
    stepped = dict(same, **{"layer.weight": same["layer.weight"] - 1e-5 * torch.sign(torch.randn(64, 64))})
    assert weights_fingerprint(stepped) != weights_fingerprint(state)  # an Adam-like step of one layer
