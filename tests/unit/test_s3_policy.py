"""infra/s3/'s policies as SeaweedFS identities (grpo_steps/dev/s3_policy.py): the shipped files translate to exactly
the rights deploy.md gives each identity, and what cannot be expressed is refused."""

import json

import pytest

from grpo_steps.config import REPO_ROOT
from grpo_steps.dev.s3_policy import PolicyError, identity, seaweed_actions

POLICIES = REPO_ROOT / "infra" / "s3"


def test_the_flows_keys_get_the_datastore_and_the_data_root_and_list_the_bucket():
    assert seaweed_actions(json.loads((POLICIES / "flow-policy.json").read_text())) == [
        "List:grpo-metaflow",
        "Read:grpo-metaflow/data/*", "Read:grpo-metaflow/metaflow/*",
        "Write:grpo-metaflow/data/*", "Write:grpo-metaflow/metaflow/*",
    ]


def test_the_server_pods_keys_read_and_list_the_weight_versions_alone():
    entry = identity("server", "AK", "SK", POLICIES / "weights-read-policy.json")
    assert entry == {"name": "server", "credentials": [{"accessKey": "AK", "secretKey": "SK"}],
                     "actions": ["List:grpo-metaflow/metaflow/weight-sync/*",
                                 "Read:grpo-metaflow/metaflow/weight-sync/*"]}


@pytest.mark.parametrize("statement, fault", [
    ({"Effect": "Deny", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}, "only Allow"),
    ({"Effect": "Allow", "Action": "s3:PutBucketPolicy", "Resource": "arn:aws:s3:::b"}, "no SeaweedFS action"),
    ({"Effect": "Allow", "Action": "s3:GetObject", "Resource": "b/*"}, "not an S3 ARN"),
    ({"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b"}, "applies to objects"),
    ({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b/k"}, "applies to a bucket"),
    ({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
      "Condition": {"IpAddress": {"aws:SourceIp": "10.0.0.0/8"}}}, "only a StringLike s3:prefix"),
])
def test_a_right_that_cannot_be_given_exactly_is_refused(statement, fault):
    with pytest.raises(PolicyError, match=fault):
        seaweed_actions({"Statement": [statement]})
