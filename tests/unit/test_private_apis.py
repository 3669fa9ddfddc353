"""What the pipeline assumes of Metaflow, metaflow-checkpoint and MLflow beyond their public APIs, pinned here as
``test_trl_contract.py`` pins TRL's: an upgrade that moves one of these fails this file, not a run.

- metaflow-checkpoint 0.2 has no public delete (``DatastoreCheckpointCallback._prune`` goes through the task
  ``Checkpoint``'s checkpointer datastore) and no public look-up of a key's metadata (``check_reference``).
- MLflow: the input tag of a dataset's context (``tracking.log_datasets`` builds the input with public entities).
- DeepSpeed: its op table ``deepspeed.ops.__compatible_ops__``, where ZeRO-3 on CPU turns the shared-memory
  allreduce op off before the process group starts (``training/entry.py``: no C++ build, gloo's collectives).
"""

import inspect

import metaflow  # noqa: F401  (metaflow-checkpoint's modules import only after metaflow has loaded its plugins)
from metaflow_extensions.obcheckpoint.plugins.machine_learning_utilities.checkpoints import core, final_api
from metaflow_extensions.obcheckpoint.plugins.machine_learning_utilities.datastructures import CheckpointArtifact

from grpo_steps.training import callbacks


def test_the_checkpoint_datastore_delete_the_prune_uses():
    prune = inspect.getsource(callbacks.DatastoreCheckpointCallback._prune)
    assert "self.checkpointer._checkpointer._checkpoint_datastore" in prune and "CheckpointArtifact.hydrate(" in prune
    assert "self._checkpointer = checkpointer" in inspect.getsource(final_api.Checkpoint)
    assert "_checkpoint_datastore" in core.Checkpointer.__annotations__
    delete = inspect.signature(core.CheckpointDatastore.delete)
    assert list(delete.parameters) == ["self", "checkpoint_artifact"]
    assert list(inspect.signature(CheckpointArtifact.hydrate).parameters) == ["data"]


def test_the_key_metadata_look_up_check_reference_uses():
    assert list(inspect.signature(CheckpointArtifact._load_metadata_from_key).parameters) == ["key", "storage_backend"]
    found = inspect.getsource(CheckpointArtifact._load_metadata_from_key)
    assert "return" in found


def test_mlflows_dataset_context_tag():
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from grpo_steps.tracking import DATASET_CONTEXT_TAG

    assert DATASET_CONTEXT_TAG == MLFLOW_DATASET_CONTEXT


def test_deepspeeds_op_table_decides_whether_the_shared_memory_op_is_built():
    import importlib

    import deepspeed

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # ``deepspeed.comm.torch`` the attribute is torch
    ops = deepspeed.ops.__compatible_ops__
    assert isinstance(ops, dict) and "deepspeed_shm_comm" in ops
    build = inspect.getsource(ds_torch.build_shm_op)
    assert "deepspeed.ops.__compatible_ops__.get(builder.NAME, False)" in build and "return None" in build
    assert "self.shm_comm_op = build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__)
    entry = inspect.getsource(importlib.import_module("grpo_steps.training.entry").run)
    assert 'deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False' in entry
