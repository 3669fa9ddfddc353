"""Put the flow on Kubernetes when the run config names an image: a Metaflow ``FlowMutator``.

A config whose ``resources.train.image`` is set targets a cluster: every step gets
``@kubernetes(image=...)`` (with ``resources.namespace`` and the shared volume at ``/shared``), so
``python flows/grpo_flow.py --config config configs/multinode.yaml run`` runs each step in a pod and
``argo-workflows create`` deploys the same. Node sizes come from the ``@resources`` decorator of
``train``, which ``@kubernetes`` reads (Metaflow takes the larger of the two). Configs without an
image (``configs/local.yaml``, ``configs/test.yaml``) leave the flow untouched: steps run locally.

The user's own modules travel with the run: a reward, tool or environment module found in the config's
``module_dirs`` (the config file's directory, the working directory) is added to Metaflow's code package through the
mutator's ``add_to_package`` hook (``ContentType.MODULE_CONTENT``: importable by its name in every step of the
package, on Kubernetes and Argo alike). A module found elsewhere on ``sys.path`` (``PYTHONPATH``) reaches no pod: a
run whose steps go to Kubernetes (``--with kubernetes``, an image in the config, ``argo-workflows create``) is
refused before anything starts, saying how to ship it. One from the installed packages must be in the image. Such a
run is refused too when the server pods' S3 Secret is one of the flow's own (:func:`server_secret`).
"""

from __future__ import annotations

import sys

from metaflow import FlowMutator

REMOTE_COMMANDS = ("argo-workflows", "step-functions", "airflow")
"""Metaflow commands that deploy the flow to run its steps elsewhere."""


class OnKubernetes(FlowMutator):
    """Add ``@kubernetes(image=config.resources.train.image)`` to every step when the image is set, and
    with ``generation.provider: kubernetes`` an ``@exit_hook`` that deletes a failed run's server (the
    flow file's ``teardown_server``; the hook looks it up in the flow file, so a run orchestrated
    locally must start from ``flows/``; on Argo it always does) and, at ``argo-workflows create``, the run's token
    Secret on the steps that reach its server from pods of their own (:func:`run_token_secrets`)."""

    def pre_mutate(self, mutable_flow) -> None:
        from metaflow import exit_hook

        from grpo_steps.config import SHARED_MOUNT
        from grpo_steps.launch import cluster_port

        config = dict(mutable_flow.configs).get("config")
        self._user_modules = user_modules(config) if config is not None else []  # for add_to_package
        if config is None or not config.resources.train.image:
            return
        if config.generation.provider == "kubernetes":
            mutable_flow.add_decorator(exit_hook, deco_kwargs={"on_error": ["teardown_server"]})
        kwargs = {"image": config.resources.train.image, "namespace": config.resources.namespace}
        if config.resources.shared_volume_claim:
            kwargs["persistent_volume_claims"] = {config.resources.shared_volume_claim: SHARED_MOUNT}
        token = run_token_secrets(config.generation.provider)
        for name, mutable_step in mutable_flow.steps:
            secrets = {"secrets": token} if token and name in TOKEN_STEPS else {}
            # the gang's rendezvous: Metaflow renders it into the JobSet as MF_MASTER_PORT ("None" without it), which
            # the train step hands to accelerate (steps.train)
            port = {"port": cluster_port(config.train.main_process_port)} if name == "train" else {}
            mutable_step.add_decorator("kubernetes", deco_kwargs={**kwargs, **secrets, **port})

    def mutate(self, mutable_flow) -> None:
        """After the command line (``--with kubernetes`` included): a run whose steps leave this machine refuses a
        user module that no code package or image carries. Checked where the run is launched, not in its steps
        (a step in a pod imports the module from the unpacked code package, which is no ``module_dirs`` entry)."""
        if {"step", "init"} & set(sys.argv):  # a task's own process (Metaflow's `step` / `init` commands)
            return
        remote = any(arg in REMOTE_COMMANDS for arg in sys.argv) or any(
            step.has_decorator("kubernetes") for _, step in mutable_flow.steps)
        if remote:
            unshipped(getattr(self, "_user_modules", []))
            config = dict(mutable_flow.configs).get("config")
            if config is not None:
                server_secret(config.resources.vllm.s3_secret_name)

    def add_to_package(self):
        """Metaflow's hook for the code package: each user module found in the config's ``module_dirs``, importable
        by its name wherever the package is unpacked: a single-file module as a module (``MODULE_CONTENT``), a
        package as its files under the code directory (``CODE_CONTENT``: Metaflow 2.19's ``add_module`` takes a
        package's ``__file__`` for a single file and would ship its ``__init__.py`` alone, as ``name.py``).

        Raises:
            ValueError: a link in a user package points outside it (names the link and its target)."""
        import importlib

        from metaflow.packaging_sys import ContentType

        from rewards.locate import origin, top_file

        for name in getattr(self, "_user_modules", []):
            if origin(name) != "module_dirs":
                continue
            found = top_file(name)
            if found.is_dir():
                for path in sorted(found.rglob("*")):
                    if path.is_symlink() and not path.resolve().is_relative_to(found):
                        # the package would carry the link's target (a key file, anything this user reads) into the
                        # datastore and every pod: refused, not skipped, so the package never ships without it
                        raise ValueError(f"{path} (in user package {name!r}) is a link to {path.resolve()}, outside "
                                         f"the package {found}: Metaflow's code package would ship that file; "
                                         "copy the file into the package or remove the link")
                    if path.is_file() and "__pycache__" not in path.parts:
                        yield str(path), str(path.relative_to(found.parent)), ContentType.CODE_CONTENT
            else:
                yield importlib.import_module(name), None, ContentType.MODULE_CONTENT


TOKEN_STEPS = ("train", "evaluate")
"""The steps that reach the run's ``kubernetes`` server from pods of their own (``provision_vllm`` started it and
keeps the token it made; ``end`` and the exit hook only delete the run's objects)."""


def run_token_secrets(provider: str, argv: list[str] | None = None) -> list[str]:
    """``@kubernetes(secrets=...)`` of :data:`TOKEN_STEPS`: the run's token Secret
    (:data:`grpo_steps.servers.k8s_manifests.ARGO_TOKEN_SECRET`, named per run by Argo's substitution of
    ``{{workflow.name}}``), when ``argo-workflows`` deploys a flow whose provider is ``kubernetes``; else none.
    The kubelet puts the Secret's key in the pod's process variables (``GRPO_SERVER_TOKEN``), so the flow's account
    needs no right to read Secrets, and no run's pod names another run's Secret (the WorkflowTemplate is the
    deployer's). Metaflow's ``envFrom`` is not optional: a pod of a step before ``provision_vllm`` would wait for
    the Secret."""
    from grpo_steps.servers.k8s_manifests import ARGO_TOKEN_SECRET

    argv = sys.argv if argv is None else argv
    return [ARGO_TOKEN_SECRET] if provider == "kubernetes" and "argo-workflows" in argv else []


def user_modules(config) -> list[str]:
    """The top-level modules of the config's dotted reward, tool and environment paths, leaving out the pipeline's own
    packages (always in the code package). An environment's adapter prefix is no module: ``gym:module:Class`` names
    ``module``, ``textarena:<id>`` the installed ``textarena`` (which the launching process need not import)."""
    from grpo_steps.tools.games import module_of
    from rewards import REGISTRY

    paths = [spec["name"] for spec in config["rewards"] if spec["name"] not in REGISTRY]
    paths += list(config["tools"] or [])
    environment = config["environment"]
    specs = [environment] if isinstance(environment, str) else list((environment or {}).values())  # or {name: spec}
    paths += [module_of(spec) for spec in specs]
    names = {path.replace(":", ".").split(".")[0] for path in paths}
    return sorted(names - {"grpo_steps", "rewards"})


def unshipped(names: list[str]) -> None:
    """Refuse modules that a step on another machine could not import.

    Raises:
        metaflow.exception.MetaflowException: a module found neither in the config's ``module_dirs`` (shipped in
            the code package) nor in the installed packages (the image's); names the module, its file and the fix.
    """
    from metaflow.exception import MetaflowException

    from rewards.locate import origin, top_file

    lost = [f"{name} ({top_file(name)})" for name in names if origin(name) == "elsewhere"]
    if lost:
        refused = type("Refused", (MetaflowException,), {"headline": "Run refused: a module the steps cannot import"})
        raise refused(f"{', '.join(lost)} is found on this machine's Python path only (PYTHONPATH), which no step "
                      "on Kubernetes has: put the module beside the config file or in the working directory (both "
                      "travel in Metaflow's code package), or install it in the image (resources.train.image)")


def server_secret(name: str | None) -> None:
    """Refuse, where the run is launched, server pods given the flow's own S3 Secret
    (:func:`grpo_steps.preflight.check_server_secret`, which ``start`` runs again in its pod).

    Raises:
        metaflow.exception.MetaflowException: ``name`` is one of Metaflow's configured Secrets; the message names the
            fix.
    """
    from metaflow.exception import MetaflowException

    from grpo_steps.config import ConfigError
    from grpo_steps.preflight import check_server_secret

    try:
        check_server_secret(name)
    except ConfigError as err:
        refused = type("Refused", (MetaflowException,), {"headline": "Run refused: the server pods' S3 Secret"})
        raise refused(str(err)) from None
