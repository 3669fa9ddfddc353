"""A flow of two steps around a ``train`` gang, for ``tests/integration/test_elastic_resume.py``: the datastore side of
a node-count resize by ``train.resume_from: FlowName/run_id``, without GRPOFlow's server, data and evaluation.

``--nodes N --save DIR``: the gang's node ``i`` saves ``DIR/node<i>`` to the datastore as GRPOFlow's training does
(:class:`grpo_steps.training.callbacks.DatastoreCheckpointCallback`: name ``grpo-node<i>``, the global step in the
metadata). ``--nodes M --resume-from FLOW/RUN --out DIR``: each node resolves the reference as GRPOFlow's ``train``
step does (:func:`grpo_steps.checkpoints.resume_checkpoint`) and copies what it got to ``DIR/node<i>``.
"""

import json
import shutil
from pathlib import Path

from metaflow import Checkpoint, FlowSpec, Parameter, checkpoint, current, parallel, step


class GangCheckpointFlow(FlowSpec):
    nodes = Parameter("nodes", type=int, default=2)
    save = Parameter("save", default="")
    resume_from = Parameter("resume-from", default="")
    out = Parameter("out", default="")

    @step
    def start(self):
        self.next(self.train, num_parallel=self.nodes)

    @checkpoint(load_policy="none", show_card=False)
    @parallel
    @step
    def train(self):
        from grpo_steps.checkpoints import checkpoint_name, resume_checkpoint

        node = current.parallel.node_index
        if self.save:
            path = Path(self.save) / f"node{node}"
            step = json.loads((path / "trainer_state.json").read_text())["global_step"]
            Checkpoint().save(path=str(path), name=checkpoint_name(node), metadata={"global_step": step,
                                                                                   "node_index": node})
        else:
            shutil.copytree(resume_checkpoint(node, self.resume_from), Path(self.out) / f"node{node}")
        self.next(self.join)

    @step
    def join(self, inputs):
        self.next(self.end)

    @step
    def end(self):
        pass


if __name__ == "__main__":
    GangCheckpointFlow()
