"""``train.resume_from`` as a run's S3 location, where no metadata service can be reached (grpo_steps/run_location.py):
``start``'s check reads the run's gang and checkpoint records from the datastore with the flow's keys scoped as
infra/s3/flow-policy.json, and refuses a location that names no usable run. The layout is metaflow-checkpoint 0.2's, as
a run on the S3 datastore leaves it (a whole run killed and resumed this way: ``make rehearse``)."""

import json
import os
import subprocess
import sys

import pytest

from grpo_steps.config import REPO_ROOT
from grpo_steps.dev import local_s3
from grpo_steps.dev.s3_policy import identity

pytestmark = pytest.mark.s3
BUCKET = "grpo-metaflow"
ROOT = f"s3://{BUCKET}/metaflow"
CHECK = """
import json, sys
from grpo_steps.checkpoints import CheckpointNotFound, check_reference
answers = []
for reference, nodes in json.loads(sys.argv[1]):
    try:
        answers.append(check_reference(reference, nodes))
    except CheckpointNotFound as err:
        answers.append("refused: " + str(err))
print(json.dumps(answers))
"""


def _record(task: str, attempt: int, node: int, version: int, step: int) -> dict:
    """One checkpoint record as metaflow-checkpoint writes it beside the task (a trimmed copy of a real one)."""
    return {"pathspec": f"GRPOFlow/argo-r1/train/{task}", "attempt": str(attempt), "name": f"grpo-node{node}",
            "key": f"mf.checkpoints/checkpoints/artifacts/GRPOFlow/train/e2cf/07b4/892f.{attempt}.grpo-node{node}."
                   f"{version}", "type": "checkpoint", "metadata": {"global_step": step, "node_index": node},
            "storage_format": "files", "version_id": version}


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    keys = {"AWS_ACCESS_KEY_ID": "flow-key", "AWS_SECRET_ACCESS_KEY": "flow-secret"}
    server = local_s3.start(tmp_path_factory.mktemp("s3"), bucket=BUCKET, identities=[
        identity("flow", *keys.values(), REPO_ROOT / "infra" / "s3" / "flow-policy.json")])
    try:
        admin = server.client()
        for key in ["GRPOFlow/argo-r1/start/t-1/0.attempt.json", "GRPOFlow/argo-r1/train/control-e1-0/0.attempt.json",
                    "GRPOFlow/argo-r1/train/worker-e1-0/0.attempt.json", "GRPOFlow/argo-r2/start/t-1/0.attempt.json"]:
            admin.put_object(Bucket=BUCKET, Key=f"metaflow/{key}", Body=b"{}")
        # node 0 saved steps 1 and 2 (the second in a retry), node 1 step 1 only: the gang resumes at step 1
        for task, attempt, node, version, step in [("control-e1-0", 0, 0, 0, 1), ("control-e1-0", 1, 0, 0, 2),
                                                   ("worker-e1-0", 0, 1, 0, 1)]:
            admin.put_object(Bucket=BUCKET, Key=f"metaflow/mf.checkpoints/checkpoints/metadata/GRPOFlow/argo-r1/train/"
                             f"{task}/{attempt}.grpo-node{node}.{version}.metadata",
                             Body=json.dumps(_record(task, attempt, node, version, step)).encode())
        cases = [(f"{ROOT}/GRPOFlow/argo-r1", 2), (f"{ROOT}/GRPOFlow/argo-r1/", 1),
                 (f"s3://{BUCKET}/elsewhere/GRPOFlow/argo-r1", 2), (f"{ROOT}/GRPOFlow", 2),
                 (f"{ROOT}/GRPOFlow/argo-r2", 2), (f"{ROOT}/GRPOFlow/argo-r9", 2)]
        env = {**os.environ, **keys, "METAFLOW_DEFAULT_DATASTORE": "s3", "METAFLOW_DATASTORE_SYSROOT_S3": ROOT,
               "METAFLOW_S3_ENDPOINT_URL": server.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        out = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases)], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        yield dict(zip([c[0] for c in cases], json.loads(out.stdout.splitlines()[-1]), strict=True))
    finally:
        local_s3.stop(server)


def test_a_runs_location_names_its_gangs_newest_common_checkpoint(answers):
    assert answers[f"{ROOT}/GRPOFlow/argo-r1"] == f"run {ROOT}/GRPOFlow/argo-r1, step 1 (nodes: [1, 1])"
    # continued by a gang of another size (docs/elastic-resume.md): every saved node's partitions are loaded
    assert answers[f"{ROOT}/GRPOFlow/argo-r1/"].endswith("step 1 (nodes: [1, 1]), saved by 2 nodes, continued on 1")


def test_a_location_that_names_no_usable_run_is_refused_saying_what_to_give(answers):
    assert answers[f"s3://{BUCKET}/elsewhere/GRPOFlow/argo-r1"].startswith("refused: ")
    assert f"not under this run's datastore {ROOT}" in answers[f"s3://{BUCKET}/elsewhere/GRPOFlow/argo-r1"]
    assert f"a run's location is {ROOT}/<FlowName>/<run id>" in answers[f"{ROOT}/GRPOFlow"]
    assert "the run has the steps start: it never reached train" in answers[f"{ROOT}/GRPOFlow/argo-r2"]
    assert f"no run there: runs of GRPOFlow are under {ROOT}/GRPOFlow/" in answers[f"{ROOT}/GRPOFlow/argo-r9"]
