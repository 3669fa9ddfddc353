"""The policies of infra/s3/ enforced by the local S3 (SeaweedFS identities from grpo_steps/dev/s3_policy.py), as the
rehearsal gives them to the pods: the server pods' keys read and list the weight versions and nothing else, and write
nowhere; the flow's keys write the datastore and the data root, not beside them."""

import boto3
import pytest
from botocore.exceptions import ClientError

from grpo_steps.config import REPO_ROOT
from grpo_steps.dev import local_s3
from grpo_steps.dev.s3_policy import identity

pytestmark = pytest.mark.s3
POLICIES = REPO_ROOT / "infra" / "s3"
BUCKET = "grpo-metaflow"


@pytest.fixture(scope="module")
def scoped(tmp_path_factory):
    """(admin client, flow client, server client) on one SeaweedFS with the two scoped identities."""
    keys = {"flow": ("flow-key", "flow-secret"), "server": ("server-key", "server-secret")}
    server = local_s3.start(tmp_path_factory.mktemp("s3"), bucket=BUCKET, identities=[
        identity("flow", *keys["flow"], POLICIES / "flow-policy.json"),
        identity("server", *keys["server"], POLICIES / "weights-read-policy.json")])

    def client(access_key, secret_key):
        return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=access_key,
                            aws_secret_access_key=secret_key, region_name="us-east-1")

    yield client(server.access_key, server.secret_key), client(*keys["flow"]), client(*keys["server"])
    local_s3.stop(server)


def _denied(call, **kwargs) -> bool:
    try:
        call(Bucket=BUCKET, **kwargs)
    except ClientError as error:
        return error.response["Error"]["Code"] == "AccessDenied"
    return False


def test_the_server_pods_keys_read_the_weight_versions_and_nothing_else(scoped):
    admin, _, server = scoped
    admin.put_object(Bucket=BUCKET, Key="metaflow/weight-sync/run-1/manifest.json", Body=b"{}")
    admin.put_object(Bucket=BUCKET, Key="metaflow/GRPOFlow/data/ab/cd", Body=b"artifact")
    admin.put_object(Bucket=BUCKET, Key="data/prompts.jsonl", Body=b"{}")
    body = server.get_object(Bucket=BUCKET, Key="metaflow/weight-sync/run-1/manifest.json")["Body"].read()
    assert body == b"{}"
    listed = server.list_objects_v2(Bucket=BUCKET, Prefix="metaflow/weight-sync/")
    assert [o["Key"] for o in listed["Contents"]] == ["metaflow/weight-sync/run-1/manifest.json"]
    # outside the prefix: neither read nor list
    assert _denied(server.get_object, Key="metaflow/GRPOFlow/data/ab/cd")
    assert _denied(server.get_object, Key="data/prompts.jsonl")
    assert _denied(server.list_objects_v2, Prefix="metaflow/")
    assert _denied(server.list_objects_v2)
    # and no write anywhere, its own prefix included
    assert _denied(server.put_object, Key="metaflow/weight-sync/run-1/manifest.json", Body=b"forged")
    assert _denied(server.put_object, Key="metaflow/GRPOFlow/data/ab/cd", Body=b"forged")
    assert _denied(server.delete_object, Key="metaflow/weight-sync/run-1/manifest.json")
    assert admin.get_object(Bucket=BUCKET, Key="metaflow/weight-sync/run-1/manifest.json")["Body"].read() == b"{}"


def test_the_flows_keys_write_the_datastore_and_the_data_root_only(scoped):
    admin, flow, _ = scoped
    for key in ("metaflow/GRPOFlow/1/_parameters/0", "metaflow/weight-sync/run-2/manifest.json", "data/x.jsonl"):
        flow.put_object(Bucket=BUCKET, Key=key, Body=b"1")
        assert flow.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"1"
    assert "Contents" in flow.list_objects_v2(Bucket=BUCKET, Prefix="metaflow/")
    assert _denied(flow.put_object, Key="mlflow/1/artifacts/model.safetensors", Body=b"1")
    admin.put_object(Bucket=BUCKET, Key="mlflow/1/meta", Body=b"m")
    assert _denied(flow.get_object, Key="mlflow/1/meta")
