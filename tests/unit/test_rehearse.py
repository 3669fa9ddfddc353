"""What the rehearsal (grpo_steps/dev/rehearse.py) takes from the shipped files: the flow's image environment
(infra/Dockerfile's flow target, and what the rendered pods need of it) and the rehearsed config."""

import re

import yaml

from grpo_steps.config import REPO_ROOT, validate_config
from grpo_steps.dev.rehearse import image_env, rehearsal_config


def test_the_pods_do_not_pip_install_into_an_image_without_pip():
    """Metaflow's rendered command runs ``python -m pip install ... boto3 requests`` unless
    ``METAFLOW_SKIP_INSTALL_DEPENDENCIES`` is set. The image's /opt/venv is made by ``uv sync``, which seeds no pip,
    and the lock holds none: every step's pod would exit 1 on "No module named pip" (and would need PyPI otherwise).
    boto3 and requests come from the lock."""
    lock = (REPO_ROOT / "uv.lock").read_text()
    assert not re.search(r'^name = "pip"$', lock, flags=re.M)
    assert image_env().get("METAFLOW_SKIP_INSTALL_DEPENDENCIES")
    assert re.search(r'^name = "boto3"$', lock, flags=re.M) and re.search(r'^name = "requests"$', lock, flags=re.M)


def test_the_image_environment_leads_to_this_checkouts_environment():
    env = image_env(venv_bin="/venv/bin")
    assert env["PATH"].startswith("/venv/bin:") and env["VIRTUAL_ENV"] == "/venv"
    assert env["GRPO_INFRA_DIR"] == str(REPO_ROOT / "infra") and env["USER"] == "grpo"


def test_the_rehearsed_config_is_the_shipped_cluster_config_at_the_tiny_models_size():
    shipped = yaml.safe_load((REPO_ROOT / "configs" / "multinode.yaml").read_text())
    cfg = validate_config(rehearsal_config(nodes=2, tracking_uri="http://127.0.0.1:5000"))
    assert (cfg.project, cfg.resources.namespace, cfg.resources.train.image) == (
        shipped["project"], shipped["resources"]["namespace"], shipped["resources"]["train"]["image"])
    assert cfg.schedule.cron == shipped["schedule"]["cron"] and cfg.train.deepspeed and cfg.train.retries == 2
    assert cfg.train.num_nodes == 2 and cfg.train.processes_per_node == cfg.resources.train.gpu == 1
    assert cfg.model.name_or_path == "embedded:tiny-random-qwen2" and cfg.generation.backend == "hf"
    assert cfg.train.save_steps == 1 < cfg.train.max_steps  # a checkpoint before the end, to kill the run after
    assert cfg.train.resume_from is None and not cfg.train.trust_checkpoint


def test_the_resumed_run_continues_the_killed_runs_location_on_the_rehearsals_rendezvous_port():
    location = "s3://grpo-metaflow/metaflow/GRPOFlow/argo-grpo.user.rehearsal.grpoflow-x7k2q"
    cfg = validate_config(rehearsal_config(nodes=2, tracking_uri="http://127.0.0.1:5000", port=31234,
                                           resume_from=location))
    # DeepSpeed unpickles its optimizer state: the rehearsal resumes a checkpoint it saved itself
    assert (cfg.train.resume_from, cfg.train.trust_checkpoint, cfg.train.deepspeed) == (location, True, True)
    assert cfg.train.main_process_port == 31234
