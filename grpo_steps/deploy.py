"""Put the flow on Kubernetes when the run config names an image: a Metaflow ``FlowMutator``.

A config whose ``resources.train.image`` is set targets a cluster: every step gets
``@kubernetes(image=...)`` (with ``resources.namespace`` and the shared volume at ``/shared``), so
``python flows/grpo_flow.py --config config configs/multinode.yaml run`` runs each step in a pod and
``argo-workflows create`` deploys the same. Node sizes come from the ``@resources`` decorator of
``train``, which ``@kubernetes`` reads (Metaflow takes the larger of the two). Configs without an
image (``configs/local.yaml``, ``configs/test.yaml``) leave the flow untouched: steps run locally.
"""

from __future__ import annotations

from metaflow import FlowMutator


class OnKubernetes(FlowMutator):
    """Add ``@kubernetes(image=config.resources.train.image)`` to every step when the image is set, and
    with ``generation.provider: kubernetes`` an ``@exit_hook`` that deletes a failed run's server (the
    flow file's ``teardown_server``; the hook looks it up in the flow file, so a run orchestrated
    locally must start from ``flows/``; on Argo it always does)."""

    def pre_mutate(self, mutable_flow) -> None:
        from metaflow import exit_hook

        from grpo_steps.config import SHARED_MOUNT

        config = dict(mutable_flow.configs).get("config")
        if config is None or not config.resources.train.image:
            return
        if config.generation.provider == "kubernetes":
            mutable_flow.add_decorator(exit_hook, deco_kwargs={"on_error": ["teardown_server"]})
        kwargs = {"image": config.resources.train.image, "namespace": config.resources.namespace}
        if config.resources.shared_volume_claim:
            kwargs["persistent_volume_claims"] = {config.resources.shared_volume_claim: SHARED_MOUNT}
        for _name, mutable_step in mutable_flow.steps:
            mutable_step.add_decorator("kubernetes", deco_kwargs=kwargs)
