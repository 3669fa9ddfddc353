"""The flow with a 2-node ``@parallel`` train gang on the local runtime (nodes simulated as processes):
one DDP gang over gloo, one generation server kept by both nodes, the join merges cleanly."""

import pytest

from tests.integration.flowrun import completed_run, flow_config

pytestmark = pytest.mark.slow


def test_two_simulated_nodes_train_as_one_gang(tmp_path, tiny_model_path):
    import yaml

    config = flow_config(generation={"backend": "hf"},  # rollouts in the trainer; the server serves evaluation
                         train={"num_nodes": 2, "per_device_train_batch_size": 4, "max_steps": 2, "save_steps": 2})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    with completed_run(tmp_path, tmp_path / "cfg.yaml") as (run, log):
        assert "belongs to an earlier run" not in log  # node 1 kept node 0's server
        assert "saved step=2 node=0" in log and "saved step=2 node=1" in log
        assert run.successful
        assert len(list(run["train"])) == 2  # a task per node
