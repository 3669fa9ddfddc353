"""A run's ``train`` checkpoints read from its S3 location, where no metadata service can be reached.

With Metaflow's local metadata (a rehearsal's pods, a cluster without the metadata service of docs/deploy.md step 5) a
run made in pods cannot be named by ``FlowName/run_id``: the client API finds runs through the metadata, which each
pod kept on its own disk. The run's data is in the S3 datastore all the same, and ``train.resume_from`` may name it by
its location, ``s3://<bucket>/<prefix>/<FlowName>/<run id>`` (``<bucket>/<prefix>``: ``METAFLOW_DATASTORE_SYSROOT_S3``,
e.g. ``s3://grpo-metaflow/metaflow/GRPOFlow/argo-grpo.user.me.grpoflow-x7k2q``). Two prefixes of that root are read,
as Metaflow and metaflow-checkpoint write them:

- ``<root>/<FlowName>/<run id>/train/<task id>/``: one task per node of the ``train`` gang (its size);
- ``<root>/mf.checkpoints/checkpoints/metadata/<FlowName>/<run id>/train/<task id>/``, one record
  ``<attempt>.<name>.<version>.metadata`` (JSON) per saved checkpoint, the dict ``Checkpoint().list(...)`` returns
  (its ``key`` relative to the datastore root: the checkpoint loads from this run's datastore only, so the location
  must lie under it).

The reads go through the boto3 client Metaflow's datastore tools configure (its endpoint, keys and role). Nothing
here loads a checkpoint: :mod:`grpo_steps.checkpoints` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SCHEME = "s3://"
METADATA_PREFIX = "mf.checkpoints/checkpoints/metadata"  # metaflow-checkpoint 0.2's task metadata store


class LocationError(ValueError):
    """An S3 location that names no run of this datastore, or one whose checkpoints cannot be listed; the message says
    what to give."""


@dataclass(frozen=True)
class RunLocation:
    """``s3://<root>/<flow>/<run_id>`` split: ``root`` the datastore root it lies under (``s3://bucket/prefix``)."""

    text: str
    root: str
    flow: str
    run_id: str

    @property
    def url(self) -> str:
        return f"{self.root}/{self.flow}/{self.run_id}"


def parse_location(text: str, datastore_root: str | None) -> RunLocation:
    """Split a run's S3 location; ``datastore_root``: this run's ``METAFLOW_DATASTORE_SYSROOT_S3`` (None: this run's
    datastore is not S3).

    Raises:
        LocationError: not ``<datastore_root>/<FlowName>/<run id>``, or this run's datastore is another one.

    >>> parse_location("s3://b/metaflow/GRPOFlow/argo-x/", "s3://b/metaflow").run_id
    'argo-x'
    """
    where = f"train.resume_from {text!r}"
    if datastore_root is None:
        raise LocationError(f"{where}: a run's S3 location loads through the S3 datastore, and this run's datastore "
                            "is not S3 (set METAFLOW_DEFAULT_DATASTORE=s3 and METAFLOW_DATASTORE_SYSROOT_S3, as the "
                            "profile infra/metaflow/config-k8s-argo.json does)")
    root = datastore_root.rstrip("/")
    if not text.startswith(root + "/"):
        raise LocationError(f"{where}: not under this run's datastore {root} (METAFLOW_DATASTORE_SYSROOT_S3): a "
                            "checkpoint loads from the datastore that saved it; give "
                            f"{root}/<FlowName>/<run id>")
    parts = text[len(root) + 1:].strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        raise LocationError(f"{where}: a run's location is {root}/<FlowName>/<run id>, not {len(parts)} part(s) "
                            f"after the datastore root ({'/'.join(parts)!r})")
    return RunLocation(text, root, parts[0], parts[1])


def _split(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    bucket, _, key = url.removeprefix(SCHEME).partition("/")
    return bucket, key


def _children(client, url: str) -> list[str]:
    """The names directly under the S3 "folder" ``url`` (sub-folders and objects)."""
    bucket, prefix = _split(url.rstrip("/") + "/")
    names = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []))
        names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
    return sorted(names)


def checkpoint_records(client, root: str, flow: str, run_id: str) -> list[dict]:
    """Every checkpoint record (JSON) the ``train`` tasks of run ``flow/run_id`` saved under the datastore ``root``
    (``s3://bucket/prefix``), through the boto3 S3 ``client``."""
    bucket, prefix = _split(f"{root}/{METADATA_PREFIX}/{flow}/{run_id}/train/")
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", []) if o["Key"].endswith(".metadata")]
    return [json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read()) for key in keys]


@dataclass(frozen=True)
class SavedGang:
    """A run's ``train`` gang as its location holds it: ``nodes`` (tasks of the gang) and ``checkpoints`` (name ->
    the records of every attempt, as ``Checkpoint().list`` gives them, oldest first)."""

    nodes: int
    checkpoints: dict[str, list[dict]]

    def list_node(self, name: str) -> list[dict]:
        return self.checkpoints.get(name, [])


def saved_gang(location: RunLocation) -> SavedGang:
    """The ``train`` gang of the run at ``location`` and its checkpoint records (module docstring).

    Raises:
        LocationError: no ``train`` task there (no such run, or it never reached ``train``), or S3 refused a list or
            a read (the keys' policy; the message has S3's answer).
    """
    # Metaflow's boto3 client as its datastore configures it (endpoint, keys, role): a few calls, no s3op processes
    from metaflow.plugins.datatools.s3.s3util import get_s3_client

    client, client_error = get_s3_client()
    where = f"train.resume_from {location.text!r}"
    try:
        tasks = _children(client, f"{location.url}/train")
        if not tasks:
            found = _children(client, location.url)
            raise LocationError(f"{where}: no train step under {location.url}/ (" + (
                f"the run has the steps {', '.join(found)}: it never reached train)" if found else
                f"no run there: runs of {location.flow} are under {location.root}/{location.flow}/)"))
        records = checkpoint_records(client, location.root, location.flow, location.run_id)
    except client_error as err:
        raise LocationError(f"{where}: S3 refused a read under {location.root}: {err}") from err
    checkpoints: dict[str, list[dict]] = {}
    for record in sorted(records, key=lambda r: (int(r.get("attempt", 0)), r.get("version_id", 0))):
        checkpoints.setdefault(record["name"], []).append(record)
    return SavedGang(len(tasks), checkpoints)
