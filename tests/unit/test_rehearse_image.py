"""What the rehearsal takes from the flow's image (infra/Dockerfile's flow target) and what the rendered pods need
of it."""

import re

from grpo_steps.config import REPO_ROOT
from grpo_steps.dev.rehearse import image_env


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
