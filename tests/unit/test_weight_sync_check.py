"""Which weights a server serves, judged from probe logprobs (``grpo_steps.weight_sync.served_version``), and the
error that names the step and both versions."""

import pytest

from grpo_steps.weight_sync import GenerationServerError, ProbeRecord, check_served_version, served_version

TOL = 0.05
V0 = ProbeRecord(0, policy=[-1.0, -2.0], served=[-1.000001, -2.000001])
V1_POLICY = [-1.00002, -2.00002]  # one optimizer step moved the policy by less than the tolerance

CASES = [
    # (served probe of the push of version 1, history, served version)
    ([-1.00002, -2.00002], [V0], 1),  # fresh weights, up to kernel noise
    ([-1.000001, -2.000001], [V0], 0),  # bit-for-bit the previous answer although the policy moved: stale
    ([-1.5, -2.5], [V0], None),  # neither version: other weights
    ([-1.00002, -2.00002], [], 1),  # first push: nothing to compare with but the policy
    ([-1.04, -2.04], [V0], 1),  # bf16-size noise, within the tolerance
]


@pytest.mark.parametrize(("served", "history", "expected"), CASES)
def test_served_version(served, history, expected):
    assert served_version(ProbeRecord(1, V1_POLICY, served), history, TOL) == expected


def test_unchanged_policy_and_unchanged_server_is_not_stale():
    # no gradient in the step (e.g. every group scored alike): same weights, same answer
    assert served_version(ProbeRecord(1, V0.policy, V0.served), [V0], TOL) == 1


def test_the_error_names_step_and_versions():
    with pytest.raises(GenerationServerError) as err:
        check_served_version(ProbeRecord(1, V1_POLICY, V0.served), [V0], "step-1", TOL, step=2)
    assert "step 2:" in str(err.value)
    assert "expected version 1 (step-1), served version 0 (step-0)" in str(err.value)
    with pytest.raises(GenerationServerError, match="reports weight version 'default', expected 'step-1'"):
        check_served_version(ProbeRecord(1, V1_POLICY, V1_POLICY), [V0], "default", TOL, step=2)
    check_served_version(ProbeRecord(1, V1_POLICY, V1_POLICY), [V0], "step-1", TOL, step=2)  # passes
