"""Checkpoint references, the trainer checkpoint inside a loaded directory, and the MLflow step watermark."""

import pytest

from grpo_steps.checkpoints import (
    CheckpointNotFound,
    mark_latest_zero_tag,
    resolve_reference,
    trainer_checkpoint_in,
)
from grpo_steps.training.callbacks import MLflowMetricsCallback


def _trainer_checkpoint(path):
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    return path


@pytest.mark.parametrize(("layout", "expected"), [
    ([], None),  # an empty directory holds no checkpoint
    (["."], "."),  # the directory is itself a trainer checkpoint
    (["checkpoint-2"], "checkpoint-2"),  # one checkpoint inside
    (["checkpoint-2", "checkpoint-10"], "checkpoint-10"),  # newest by step, not by name order
    (["checkpoint-9", "checkpoint-10", "checkpoint-100"], "checkpoint-100"),  # three, numeric order
])
def test_trainer_checkpoint_in(tmp_path, layout, expected):
    root = tmp_path / "loaded"
    root.mkdir()
    for name in layout:
        if name == ".":
            (root / "trainer_state.json").write_text("{}")
        else:
            _trainer_checkpoint(root / name)
    expected_path = None if expected is None else str(root if expected == "." else root / expected)
    assert trainer_checkpoint_in(root) == expected_path


def test_trainer_checkpoint_in_nothing():
    assert trainer_checkpoint_in(None) is None
    assert trainer_checkpoint_in("") is None


def test_a_local_directory_reference_resolves_to_its_newest_checkpoint(tmp_path):
    _trainer_checkpoint(tmp_path / "out" / "checkpoint-4")
    _trainer_checkpoint(tmp_path / "out" / "checkpoint-12")
    assert resolve_reference(str(tmp_path / "out"), node_index=0) == str(tmp_path / "out" / "checkpoint-12")


def test_a_directory_without_a_checkpoint_is_rejected_with_the_reason(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="no trainer checkpoint"):
        resolve_reference(str(tmp_path / "empty"), node_index=0)


def test_metrics_of_steps_an_earlier_attempt_logged_are_not_logged_again(tmp_path, mlflow_db):
    from mlflow import MlflowClient

    uri = mlflow_db
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    first = MLflowMetricsCallback(run_id, uri)
    first.on_train_begin(None, None, None)
    for step in (1, 2, 3):
        first.log({"reward": float(step), first.WATERMARK: step}, step)
    first.queue.flush(timeout_s=30)  # queued points are sent in the background; these reached the store
    second = MLflowMetricsCallback(run_id, uri)  # a resumed attempt that restarts from step 2's checkpoint
    second.on_train_begin(None, None, None)
    assert second.logged_up_to == 3
    for step in (3, 4):
        second.log({"reward": 10.0 * step, second.WATERMARK: step}, step)
    second.on_train_end(None, None, None)  # drains the queue
    history = {m.step: m.value for m in client.get_metric_history(run_id, "reward")}
    assert history == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0}  # step 3 kept once, from the first attempt


def test_a_zero_checkpoint_without_its_latest_tag_gets_one(tmp_path):
    (tmp_path / "global_step4").mkdir()  # the partitions of a node other than global rank 0
    mark_latest_zero_tag(tmp_path, 4)
    assert (tmp_path / "latest").read_text() == "global_step4"
    (tmp_path / "latest").write_text("global_step3")  # rank 0 wrote its own: left as it is
    mark_latest_zero_tag(tmp_path, 4)
    assert (tmp_path / "latest").read_text() == "global_step3"
    plain = tmp_path / "plain"
    plain.mkdir()  # not a DeepSpeed checkpoint: nothing written
    mark_latest_zero_tag(plain, 4)
    assert not (plain / "latest").exists()


def test_the_flow_side_modules_import_neither_torch_nor_transformers():
    """The train and evaluate tasks import these to look checkpoints up and watch the run; torch and
    transformers (~9 s of imports on 2 CPU cores) belong to the training process and the evaluation."""
    import subprocess
    import sys

    code = ("import sys, grpo_steps.checkpoints, grpo_steps.monitor, grpo_steps.steps; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_foreign_checkpoint_that_deepspeed_would_unpickle_needs_explicit_trust():
    from grpo_steps.config import ConfigError, validate_config

    foreign = {"resume_from": "GRPOFlow/123", "deepspeed": True}
    with pytest.raises(ConfigError, match=r"train.trust_checkpoint: true") as err:
        validate_config({"train": foreign})
    assert "weights_only=False" in str(err.value)
    assert validate_config({"train": {**foreign, "trust_checkpoint": True}}).train.trust_checkpoint
    assert validate_config({"train": {"resume_from": "GRPOFlow/123"}}).train.resume_from  # weights only: no trust


def test_the_trainer_reads_checkpoint_files_as_weights_only():
    """What the refusal relies on: without DeepSpeed, the installed HF Trainer loads every pickled file of a
    checkpoint (optimizer, scheduler, scaler, RNG state) with ``weights_only=True``."""
    import inspect
    import re

    from transformers import Trainer

    source = inspect.getsource(Trainer)
    loads = re.findall(r"torch\.load\((.*?)\)\s*\n", source, flags=re.S)
    assert loads and all("weights_only=True" in call for call in loads), loads


def test_a_checkpoint_save_that_cannot_fit_is_refused_before_the_trainer_writes(small_tmpfs):
    """The callback's step-end check, on a real 256 KiB tmpfs as the output directory: a policy whose checkpoint
    (weights + two AdamW moments) is ~1.2 MiB fails before the save with the directory, the bytes and the key;
    on steps without a save, and for a checkpoint that fits, nothing is raised."""
    from types import SimpleNamespace

    import torch

    from grpo_steps.checkpoints import checkpoint_bytes
    from grpo_steps.training.callbacks import DatastoreCheckpointCallback
    from grpo_steps.weights.files import NoSpaceError

    scratch = small_tmpfs(256 * 1024)
    policy = torch.nn.Linear(320, 320, bias=False)  # 102,400 float32 parameters: 400 KiB of weights
    assert checkpoint_bytes(scratch, policy) == 102_400 * (4 + 8)
    callback, args = DatastoreCheckpointCallback(), SimpleNamespace(output_dir=str(scratch), save_total_limit=2)
    state = SimpleNamespace(global_step=4, is_local_process_zero=True)
    callback.on_step_end(args, state, SimpleNamespace(should_save=False), model=policy)  # no save this step
    with pytest.raises(NoSpaceError) as err:
        callback.on_step_end(args, state, SimpleNamespace(should_save=True), model=policy)
    assert f"checkpoint-4 needs 1228800 bytes (1 MiB) in {scratch}, which has 262144 bytes" in str(err.value)
    assert "change train.save_total_limit (local copies kept: 2)" in str(err.value)
    small = torch.nn.Linear(32, 32, bias=False)
    callback.on_step_end(args, state, SimpleNamespace(should_save=True), model=small)  # 12 KiB: fits
    (scratch / "checkpoint-2").mkdir()
    (scratch / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert checkpoint_bytes(scratch, policy) == 2  # measured from the newest checkpoint once there is one


# ---- a gang resumes at the newest step every node saved (issue 49, multi-node consistency) ----

def _node_saves(root, saved: dict[int, list[int]]) -> dict[int, list[dict]]:
    """Real trainer checkpoint directories per node (``root/node<i>/checkpoint-N``) and their datastore listings as
    metaflow-checkpoint returns them (``metadata``: global step, node index)."""
    listing = {}
    for node, steps in saved.items():
        listing[node] = []
        for step in steps:
            path = _trainer_checkpoint(root / f"node{node}" / f"checkpoint-{step}")
            listing[node].append({"key": str(path), "metadata": {"global_step": step, "node_index": node}})
    return listing


def test_a_gang_killed_between_two_nodes_saves_resumes_at_the_step_both_saved(tmp_path, capsys):
    from grpo_steps.checkpoints import _newest_common_checkpoint, _saved_by_node

    # node 0 saved step 6, node 1 was killed before its own save of step 6
    listing = _node_saves(tmp_path, {0: [2, 4, 6], 1: [2, 4]})
    saved = _saved_by_node(lambda name: listing[int(name.removeprefix("grpo-node"))], 2)
    picks = [_newest_common_checkpoint(saved, node, 2) for node in (0, 1)]
    assert [p["metadata"]["global_step"] for p in picks] == [4, 4]  # both nodes, the same step
    assert [trainer_checkpoint_in(p["key"]) for p in picks] == [str(tmp_path / f"node{n}" / "checkpoint-4")
                                                                for n in (0, 1)]
    assert "newer saves of one node only are not used: {0: 6}" in capsys.readouterr().out


def test_a_gang_with_a_node_that_never_saved_starts_fresh(tmp_path):
    from grpo_steps.checkpoints import _newest_common_checkpoint, _saved_by_node

    listing = _node_saves(tmp_path, {0: [2], 1: []})
    saved = _saved_by_node(lambda name: listing[int(name[-1])], 2)
    assert _newest_common_checkpoint(saved, 0, 2) is None


@pytest.mark.parametrize(("saved", "node", "keep", "deletable"), [
    ({0: [2, 4, 6], 1: [2, 4]}, 0, 1, [2]),  # node 1 has not saved 6 yet: node 0 keeps 4, the gang's resume step
    ({0: [2, 4, 6], 1: [2, 4, 6]}, 0, 1, [4, 2]),  # both saved 6: the older ones go
    ({0: [2, 4, 6], 1: [2, 4, 6]}, 0, 2, [2]),  # keep 2
    ({0: [2, 4], 1: []}, 0, 1, []),  # until every node saved one step, nothing is deleted
    ({0: [2, 4, 6, 8], 1: [4]}, 1, 1, []),  # the slow node keeps its only step
])
def test_pruning_keeps_the_newest_step_every_node_saved(saved, node, keep, deletable):
    from grpo_steps.checkpoints import newest_common_step, steps_to_prune

    assert steps_to_prune(saved, node, keep, num_nodes=2) == deletable
    common = newest_common_step(saved, 2)
    assert common is None or common not in deletable
