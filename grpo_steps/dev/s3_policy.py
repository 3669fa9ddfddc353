"""The S3 policies of infra/s3/ as SeaweedFS identities: the rehearsal (:mod:`grpo_steps.dev.rehearsal`) gives each
pod the keys of an identity with exactly the rights that docs/deploy.md's policy gives it.

SeaweedFS scopes an identity's action to a bucket and a key prefix with ``Action:bucket/prefix*`` (its
``s3.config`` file; ``weed/s3api/auth_credentials.go``: an action ending in ``*`` grants every target
``Action:bucket/key`` it is a prefix of). IAM's object actions map to SeaweedFS's ``Read`` (GetObject) and ``Write``
(PutObject, DeleteObject); ``s3:ListBucket`` with a ``StringLike s3:prefix`` condition to ``List`` scoped to those
prefixes, without a condition to ``List`` on the whole bucket.
"""

from __future__ import annotations

import json
from pathlib import Path

ACTIONS = {"s3:GetObject": "Read", "s3:PutObject": "Write", "s3:DeleteObject": "Write", "s3:ListBucket": "List"}
"""IAM action -> SeaweedFS action. Anything else in a policy is refused: a right the rehearsal cannot give."""
ARN = "arn:aws:s3:::"


class PolicyError(ValueError):
    """A policy the translation cannot express exactly (a Deny, an unknown action or condition, a resource that is
    not an S3 ARN)."""


def _listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def seaweed_actions(policy: dict) -> list[str]:
    """The SeaweedFS actions (``["Read:bucket/prefix/*", "List:bucket", ...]``, sorted, no duplicates) that grant
    what the IAM ``policy`` (a parsed JSON policy document) allows.

    Raises:
        PolicyError: the policy has a statement this translation cannot express exactly.

    >>> seaweed_actions({"Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
    ...     "Resource": "arn:aws:s3:::b/w/*"}, {"Effect": "Allow", "Action": "s3:ListBucket",
    ...     "Resource": "arn:aws:s3:::b", "Condition": {"StringLike": {"s3:prefix": ["w/*"]}}}]})
    ['List:b/w/*', 'Read:b/w/*', 'Write:b/w/*']
    """
    granted: set[str] = set()
    for number, statement in enumerate(policy.get("Statement", [])):
        where = f"statement {statement.get('Sid', number)}"
        if statement.get("Effect") != "Allow":
            raise PolicyError(f"{where}: only Allow statements translate (SeaweedFS identities have no Deny)")
        condition = statement.get("Condition") or {}
        prefixes = None
        if condition:
            if set(condition) != {"StringLike"} or set(condition["StringLike"]) != {"s3:prefix"}:
                raise PolicyError(f"{where}: only a StringLike s3:prefix condition translates, not {condition}")
            prefixes = _listed(condition["StringLike"]["s3:prefix"])
        for action in _listed(statement["Action"]):
            if action not in ACTIONS:
                raise PolicyError(f"{where}: {action} has no SeaweedFS action here (known: {', '.join(ACTIONS)})")
            for resource in _listed(statement["Resource"]):
                if not resource.startswith(ARN):
                    raise PolicyError(f"{where}: {resource} is not an S3 ARN ({ARN}bucket[/key])")
                target = resource.removeprefix(ARN)
                if action == "s3:ListBucket":
                    if "/" in target:
                        raise PolicyError(f"{where}: s3:ListBucket applies to a bucket, not to {resource}")
                    granted.update([f"List:{target}/{p}" for p in prefixes] if prefixes else [f"List:{target}"])
                elif prefixes is not None:
                    raise PolicyError(f"{where}: an s3:prefix condition applies to s3:ListBucket only")
                elif "/" not in target:
                    raise PolicyError(f"{where}: {action} applies to objects (bucket/key*), not to {resource}")
                else:
                    granted.add(f"{ACTIONS[action]}:{target}")
    return sorted(granted)


def identity(name: str, access_key: str, secret_key: str, policy_path: str | Path) -> dict:
    """One entry of SeaweedFS's ``s3.config`` ``identities`` list: ``name`` with one key pair and the rights of the
    policy file at ``policy_path`` (:func:`seaweed_actions`).

    Raises:
        PolicyError: as :func:`seaweed_actions`.
        OSError, json.JSONDecodeError: the file cannot be read or parsed.
    """
    return {"name": name, "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": seaweed_actions(json.loads(Path(policy_path).read_text()))}
