"""The optimizer after DeepSpeed's universal load (:mod:`grpo_steps.training.gang`). Adam's step counts
(:func:`~grpo_steps.training.gang.separate_step_counts`): one count per parameter's state again, and each on the
device torch's Adam reads it from: the CPU for the for-each and single-tensor kernels, the parameter's device for the
fused and capturable ones (torch's ``Adam._init_group``); the GPU case is a ``meta`` parameter here: any device other
than the CPU shows the choice. Each group's own settings (:func:`~grpo_steps.training.gang.restore_group_settings`)."""

import pytest
import torch

from grpo_steps.training.gang import restore_group_settings, separate_step_counts


class Wrapper:
    """Stands for accelerate's and DeepSpeed's optimizer wrappers: each holds the next as ``.optimizer``."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer


def _two_groups(device: str = "cpu", **flags) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    """transformers' two groups (decay / no-decay), one parameter each, whose Adam states share one CPU ``step``
    tensor, as DeepSpeed 0.19.8's ZeRO-3 universal load leaves them; ``flags``: set on every group afterwards, as a
    fused or capturable optimizer carries them."""
    params = [torch.nn.Parameter(torch.ones(3, device=device)) for _ in range(2)]
    optimizer = torch.optim.AdamW([{"params": [params[0]], "weight_decay": 0.1},
                                   {"params": [params[1]], "weight_decay": 0.0}], lr=0.1)
    shared = torch.tensor(2.0)
    for p in params:
        optimizer.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    for group in optimizer.param_groups:
        group.update(flags)
    return optimizer, params


def test_a_shared_count_is_split_and_each_group_then_counts_one_per_step():
    optimizer, params = _two_groups()
    assert separate_step_counts(Wrapper(Wrapper(optimizer))) == 1  # the second state's copy; the first kept its own
    steps = [optimizer.state[p]["step"] for p in params]
    assert steps[0] is not steps[1] and [s.item() for s in steps] == [2.0, 2.0]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    # shared, torch's Adam would increment the one tensor once per group: 4.0 for both, and a wrong bias correction
    assert [optimizer.state[p]["step"].item() for p in params] == [3.0, 3.0]
    assert separate_step_counts(optimizer) == 0  # nothing left to change


def test_unfused_not_capturable_kernels_keep_the_count_on_the_cpu():
    optimizer, params = _two_groups("meta", fused=False, capturable=False)
    separate_step_counts(optimizer)
    assert {optimizer.state[p]["step"].device.type for p in params} == {"cpu"}


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_fused_or_capturable_kernels_get_the_count_on_the_parameters_device(flag):
    """The GPU fault this fixes (an H200, 2026-11-27): "state_steps is on cpu, different from other tensors on
    cuda:0 (_fused_adamw_)"; a ``meta`` parameter stands for the GPU's."""
    optimizer, params = _two_groups("meta", **{flag: True})
    assert separate_step_counts(optimizer) == 2  # both moved, the first one too (it was on the wrong device)
    assert {optimizer.state[p]["step"].device.type for p in params} == {"meta"}
    assert optimizer.state[params[0]]["step"] is not optimizer.state[params[1]]["step"]


def test_a_count_already_on_the_right_device_and_not_shared_is_left_alone():
    optimizer, params = _two_groups(fused=True)  # a fused kernel on CPU parameters: the CPU is the parameter's device
    optimizer.state[params[1]]["step"] = torch.tensor(2.0)
    kept = [optimizer.state[p]["step"] for p in params]
    assert separate_step_counts(optimizer) == 0
    assert all(optimizer.state[p]["step"] is k for p, k in zip(params, kept, strict=True))


def test_each_group_gets_its_own_settings_back_after_the_universal_load():
    """DeepSpeed 0.19.8's ZeRO-3 universal load gives every group the checkpoint's group 0 settings: the no-decay
    group (biases, norms) would be decayed."""
    optimizer, params = _two_groups()
    saved = [{**g, "params": [i]} for i, g in enumerate(optimizer.state_dict()["param_groups"])]
    for group in optimizer.param_groups:  # what the load leaves
        group.update(weight_decay=0.1, betas=(0.5, 0.999))
    assert restore_group_settings(Wrapper(optimizer), saved) == 3  # group 0's betas, group 1's betas and decay
    assert [(g["weight_decay"], g["betas"]) for g in optimizer.param_groups] == [(0.1, (0.9, 0.999)),
                                                                                 (0.0, (0.9, 0.999))]
    assert [g["params"] for g in optimizer.param_groups] == [[params[0]], [params[1]]]  # the parameters untouched
    with pytest.raises(ValueError, match="holds 1 optimizer parameter groups, the optimizer 2"):
        restore_group_settings(optimizer, saved[:1])
