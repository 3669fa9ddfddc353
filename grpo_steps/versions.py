"""A registered model version as a run's start: ``model.name_or_path: models:/<name>@<alias>`` or
``models:/<name>/<version>`` (MLflow's model URIs).

``start`` resolves the URI once to one version (:func:`resolve_version`) and records it on the MLflow run
(:func:`start_tags`: the version, its run, its digest, and the pinned ``models:/<name>/<version>`` URI); every later
step resolves the pinned URI, so a ``champion`` that moves during the run does not change what the run trains from.
The version's files are fetched once per machine into ``<cache>/registry/<name>/<version>-<digest>`` with MLflow's own
``mlflow.artifacts.download_artifacts`` and checked against the digest taken at registration
(:data:`DIGEST_TAG`, :func:`model_sha256`): a version whose files were changed in the artifact store is refused.

The files are the ``model/`` folder of the transformers flavour: MLflow copies the registered directory there as it
is (``mlflow/transformers/model_io.py``, ``save_local_checkpoint``), weights and tokenizer together, so the digest
taken over the directory at registration is the digest of what a fetch returns.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from grpo_steps.config import parse_model_uri as parse_config_uri

MODELS_PREFIX = "models:/"
DIGEST_TAG = "model.sha256"
"""Version tag: :func:`model_sha256` of the registered directory (weights, config and tokenizer files)."""
WEIGHTS_DIGEST_TAG = "weights.sha256"
"""Version tag of versions registered before :data:`DIGEST_TAG` was kept: the SHA-256 of the ``*.safetensors`` files
alone (:func:`grpo_steps.weights.files.weights_sha256`)."""
REVOKED_TAG = "gate.revoked"
START_TAGS = ("start.model_uri", "start.model_version", "start.model_run_id", "start.model_sha256")
"""The MLflow run's tags naming its start: the pinned URI, the version, the version's run, its digest."""


class VersionError(ValueError):
    """A ``models:/`` start that cannot be used: it names nothing registered, or its files fail their digest."""


def is_model_uri(name_or_path: str) -> bool:
    return name_or_path.startswith(MODELS_PREFIX)


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``(name, alias, version)`` of a ``models:/`` URI (:func:`grpo_steps.config.parse_model_uri`).

    Raises:
        VersionError: any other shape (the config refuses it first).
    """
    try:
        return parse_config_uri(uri)
    except ValueError as err:
        raise VersionError(str(err)) from None


def resolve_version(client, uri: str):
    """The ``ModelVersion`` that ``uri`` names in ``client``'s registry (an ``MlflowClient``).

    Raises:
        VersionError: the registered model does not exist (names those that do), the alias or version does not
            exist (names the model's aliases and versions), or the version is tagged ``gate.revoked=true``.
    """
    from mlflow.exceptions import MlflowException

    name, alias, number = parse_model_uri(uri)
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models())
        raise VersionError(f"model.name_or_path {uri!r}: no registered model {name!r} in this registry; registered "
                           f"models: {', '.join(names) or 'none'}") from None
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    aliases = dict(sorted((model.aliases or {}).items()))
    found = (aliases.get(alias) if alias else number if int(number) in versions else None)
    if found is None:
        raise VersionError(f"model.name_or_path {uri!r}: {'alias ' + repr(alias) if alias else 'version ' + number} "
                           f"does not exist; {name!r} has versions {', '.join(map(str, versions)) or 'none'} and "
                           f"aliases {', '.join(f'{a} -> {v}' for a, v in aliases.items()) or 'none'}")
    version = client.get_model_version(name, str(found))
    if version.tags.get(REVOKED_TAG) == "true":
        raise VersionError(f"model.name_or_path {uri!r}: version {version.version} is tagged {REVOKED_TAG}=true "
                           "(rolled back); move the alias to a good version or name one by number")
    return version


def start_tags(uri: str, directory: str | Path) -> dict[str, str]:
    """The MLflow run tags (:data:`START_TAGS`) of a run that starts from ``uri``, fetched into ``directory`` by
    :func:`fetch_version` (which wrote what it resolved beside it: ``<version>.json``). The pinned URI names the
    version itself, so a later step, or a pod of another step, fetches the same one."""
    record = json.loads(Path(directory).with_suffix(".json").read_text())
    pinned = f"{MODELS_PREFIX}{record['name']}/{record['version']}"
    return dict(zip(START_TAGS, (pinned, record["version"], record["run_id"], record["digest"]), strict=True))


def model_sha256(directory: str | Path) -> str:
    """Hex SHA-256 over every file of ``directory`` (relative path, a NUL, the bytes; in path order): the
    :data:`DIGEST_TAG` of a registered version. Reads every byte once (about 1 s per GB)."""
    digest = hashlib.sha256()
    root = Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def _check_digest(version, directory: Path) -> None:
    """Raise :class:`VersionError` unless ``directory`` matches ``version``'s digest tag."""
    from grpo_steps.weights.files import weights_sha256

    expected, actual, what = version.tags.get(DIGEST_TAG), None, "files"
    if expected:
        actual = model_sha256(directory)
    elif version.tags.get(WEIGHTS_DIGEST_TAG):  # registered before the whole directory's digest was kept
        expected, actual, what = version.tags[WEIGHTS_DIGEST_TAG], weights_sha256(directory), "weight files"
    how = (f"register the model again from a trusted copy (a run with model.name_or_path set to that directory), or "
           f"tag version {version.version} {DIGEST_TAG} with `python -m grpo_steps.versions digest <dir>` of a copy "
           "you trust")
    if expected is None:
        raise VersionError(f"version {version.version} of {version.name!r} has no digest tag ({DIGEST_TAG}), so its "
                           f"files cannot be checked: {how}")
    if actual != expected:
        raise VersionError(f"version {version.version} of {version.name!r}: the {what} in the artifact store do not "
                           f"match the digest taken at registration ({what} sha256 {actual[:16]}..., tag "
                           f"{expected[:16]}...): they were changed after registration. Refused; {how}")


def fetch_version(uri: str, tracking_uri: str, cache: Path) -> tuple[Path, object]:
    """The local directory of the version ``uri`` names (its transformers flavour's ``model/`` folder: config,
    weights, tokenizer), fetched once into ``cache/registry/<name>/<version>-<digest>`` and checked by digest before
    it is moved there (concurrent processes: one fetches, under a file lock). Returns ``(directory, ModelVersion)``.

    Raises:
        VersionError: as :func:`resolve_version`; a version registered as a LoRA adapter alone (no merged weights);
            files that fail the digest (:func:`_check_digest`).
        MlflowException: the artifact store cannot be read.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    version = resolve_version(client, uri)
    if version.tags.get("lora.register") == "adapter":
        raise VersionError(f"version {version.version} of {version.name!r} holds a LoRA adapter alone "
                           "(registry.register_as: adapter): a start needs whole weights; register it merged")
    digest = version.tags.get(DIGEST_TAG) or version.tags.get(WEIGHTS_DIGEST_TAG) or "unchecked"
    # keyed by the digest too: another registry (another tracking URI) has its own version 1 of the same name
    target = cache / "registry" / version.name / f"{version.version}-{digest[:16]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not target.is_dir():
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
                # the version's own location, asked of this client: MLflow 3.17 resolves a models:/ URI through
                # the process's global registry URI whatever registry_uri says (ModelsArtifactRepository
                # ._get_model_uri_infos), another store wherever mlflow.set_tracking_uri was called
                local = mlflow.artifacts.download_artifacts(
                    artifact_uri=client.get_model_version_download_uri(version.name, version.version), dst_path=tmp,
                    tracking_uri=tracking_uri)
                _check_digest(version, Path(local) / "model")
                shutil.move(str(Path(local) / "model"), target)  # checked, then in place: never a half copy
            target.with_suffix(".json").write_text(json.dumps({
                "name": version.name, "version": str(version.version), "run_id": version.run_id or "",
                "digest": digest}))
    return target, version


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="The digest of a model directory, as registration tags it.")
    parser.add_argument("command", choices=["digest"])
    parser.add_argument("directory")
    print(model_sha256(parser.parse_args(argv).directory))


if __name__ == "__main__":
    main()
