"""GRPO post-training pipeline: data -> vLLM server -> GRPO training -> evaluation -> registry.

    python flows/grpo_flow.py run                             # configs/local.yaml
    python flows/grpo_flow.py --config config my.yaml run     # your own config
    python flows/grpo_flow.py resume                          # continue a failed run
    python flows/grpo_flow.py --config config configs/multinode.yaml argo-workflows create

Each step body only moves artifacts; the work is in ``grpo_steps``. Decorators read the config:
``@resources`` (a no-op on the local runtime), ``@retry``, ``@schedule`` and ``@project`` (deployments
only); ``resources.train.image`` set puts every step on Kubernetes (``grpo_steps.deploy``).
"""

import os

# Metaflow needs a user name other than root; a container runs as root with no other: then "grpo" (or set
# METAFLOW_USER), read by Metaflow when it is imported below and by every step process it starts.
if all(os.environ.get(name) in (None, "", "root") for name in ("METAFLOW_USER", "SUDO_USER", "USERNAME", "USER")):
    os.environ["METAFLOW_USER"] = "grpo"

from metaflow import (
    Config,
    FlowSpec,
    card,
    checkpoint,
    config_expr,
    current,
    exit_hook,
    parallel,
    project,
    resources,
    retry,
    schedule,
    step,
)

import grpo_steps  # noqa: F401  (packaged with the flow: METAFLOW_PACKAGE_POLICY)
import rewards  # noqa: F401
from grpo_steps import steps
from grpo_steps.config import DEFAULT_CONFIG
from grpo_steps.deploy import OnKubernetes


def teardown_server(run=None):
    """Exit hook of a failed run (added by OnKubernetes with provider kubernetes): stop its server."""
    steps.teardown_failed_run(run)


@OnKubernetes
@exit_hook(on_error=["grpo_steps.tracking.on_flow_error"])  # the MLflow run ends FAILED (or KILLED)
@schedule(cron=config_expr("config.schedule.cron"), timezone=config_expr("config.schedule.timezone"), daily=False)
@project(name=config_expr("config.project"))
class GRPOFlow(FlowSpec):
    config = Config("config", default=str(DEFAULT_CONFIG), parser="grpo_steps.config.parse_config",
                    help="run config YAML (see configs/ and grpo_steps/config/)")

    @step
    def start(self):
        """Validate the config and open the MLflow run."""
        cfg = steps.config_of(self.config)
        self.config_sha256 = cfg.sha256()
        self.mlflow_run_id, self.model_path = steps.start(cfg, current.pathspec.rsplit("/", 2)[0])
        self.next(self.prepare_data)

    @step
    def prepare_data(self):
        """Load the source, build prompts, deduplicate, split train/eval; no rows new to the chain: on to end."""
        cfg = steps.config_of(self.config)
        self.model_path, data, self.route = steps.prepare_data(cfg, self.mlflow_run_id, self.model_path)
        self.train_rows, self.eval_rows = data.train, data.eval
        self.data_stats, self.dataset_digest = data.stats, data.digest()
        self.next({"train": self.provision_vllm, "no_new_rows": self.end}, condition="route")

    @step
    def provision_vllm(self):
        """Start the generation server (rollouts with backend vllm, evaluation always)."""
        cfg = steps.config_of(self.config)
        model = steps.local_model(cfg, self.mlflow_run_id, self.model_path)
        self.server = steps.provision(cfg, self.mlflow_run_id, model)
        self.next(self.train, num_parallel=self.config.train.num_nodes)

    @resources(gpu=config_expr("config.resources.train.gpu"), cpu=config_expr("config.resources.train.cpu"),
               memory=config_expr("config.resources.train.memory_mib"),
               shared_memory=config_expr("config.resources.train.shared_memory_mib"),
               disk=config_expr("config.resources.train.disk_mib"))
    @retry(times=config_expr("config.train.retries"), minutes_between_retries=0)
    # load_policy none: grpo_steps.checkpoints.resume_checkpoint picks per node. show_card off: its card's collector
    # re-rendered the card every few seconds, each render a new Python process (~2 s of CPU) taken from training.
    # No @model: its card cost each train task five card processes (~11 CPU s on 2 cores, 2026-11-28); the final
    # policy is a checkpoint of its own name (steps.POLICY_CHECKPOINT), loaded with load_model as a model would be
    @checkpoint(load_policy="none", show_card=False)
    @parallel
    @step
    def train(self):
        """GRPO on every node of the gang; node 0 saves the final policy to the datastore."""
        cfg = steps.config_of(self.config)
        # a local name, not an artifact: the nodes' would differ
        model = steps.local_model(cfg, self.mlflow_run_id, self.model_path)
        self.server = steps.ensure_server(cfg, self.mlflow_run_id, self.server, model)
        with steps.scratch_dir() as workdir:
            final_dir = steps.train(cfg, run_id=self.mlflow_run_id, model_path=model,
                                    train_rows=self.train_rows, server=self.server,
                                    node_index=current.parallel.node_index, main_ip=current.parallel.main_ip,
                                    output_dir=workdir, eval_rows=self.eval_rows)
            if current.parallel.node_index == 0:
                self.policy = current.checkpoint.save(final_dir, name=steps.POLICY_CHECKPOINT, latest=False,
                                                      metadata={"run_id": self.mlflow_run_id})
                # the base weights (step 0) and the final policy (last step) measured on the whole eval split
                self.training_evaluations = steps.training_evaluations(workdir)
        self.next(self.evaluate)

    # evaluate and register load the policy with steps.loaded_policy (metaflow-checkpoint's load_model)
    @card(type="blank", id="eval")
    @step
    def evaluate(self, inputs):
        """Baseline vs trained policy on the held-out split, through the same server."""
        # with provider local in pods each gang node started a server of its own, gone with its pod (make rehearse):
        # node 0's handle (the node that saved the policy), which ensure_server checks and replaces
        self.merge_artifacts(inputs, exclude=["server"])
        self.server = next(node.server for node in inputs if hasattr(node, "policy"))
        cfg = steps.config_of(self.config)
        model = steps.local_model(cfg, self.mlflow_run_id, self.model_path)
        self.server = steps.ensure_server(cfg, self.mlflow_run_id, self.server, model, teacher=False)
        with steps.loaded_policy(self.policy) as trained_model:
            self.eval_report = steps.evaluate(cfg, run_id=self.mlflow_run_id, server=self.server,
                                              base_model=model, trained_model=trained_model,
                                              eval_rows=self.eval_rows,
                                              measured=self.training_evaluations)
        current.card["eval"].extend(steps.card_components(cfg, self.mlflow_run_id, self.eval_report))
        self.next(self.register)

    @step
    def register(self):
        """Register the policy: alias candidate; champion when the quality gate passes."""
        with steps.loaded_policy(self.policy) as model_dir:
            self.model_version = steps.register(steps.config_of(self.config), run_id=self.mlflow_run_id,
                                                model_dir=model_dir, report=self.eval_report,
                                                pathspec=current.pathspec, dataset_digest=self.dataset_digest)
        self.next(self.end)

    @step
    def end(self):
        """Stop the server and close the MLflow run."""
        trained = self.route == "train"  # else ended after prepare_data: nothing served, trained or registered
        steps.finish(steps.config_of(self.config), self.mlflow_run_id, self.server if trained else None,
                     report=self.eval_report if trained else None,
                     model_version=self.model_version if trained else None, pathspec=current.pathspec)
        if trained:
            print(f"registered {self.model_version}; trained {self.eval_report['trained']['metrics']}")


if __name__ == "__main__":
    GRPOFlow()
