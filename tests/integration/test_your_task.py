"""docs/your-task.md as a new user follows it: its commands run as written, in a scratch directory that holds
``my-task/`` (rows, the reward module beside the config, the config), with ``.venv`` and ``flows`` linked from the
checkout; the module is on no ``PYTHONPATH``. One whole flow run (on the tiny model, served by the session's
``tiny_server``: the config's model and sizes are the test's only change) trains, evaluates and registers, and
Metaflow's code package of that run holds the module. The reward contract's refusals, seen through the flow (one
run stopped in ``prepare_data``, before any server): a reward written for strings, one returning the wrong number of
scores, a correctness reward scoring in [0, 1)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from grpo_steps.config import REPO_ROOT
from tests.integration.flowrun import FLOW, flow_client, flow_env, model_versions, on_server

pytestmark = pytest.mark.slow
PAGE = REPO_ROOT / "docs" / "your-task.md"
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)  # in list items too
TINY = {"model": {"name_or_path": "embedded:tiny-random-qwen2", "dtype": "float32", "max_model_len": 256},
        "data": {"max_prompt_tokens": 200},
        "generation": {"max_completion_tokens": 12},
        "train": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "save_steps": 2},
        "eval": {"num_samples": 2, "k": [1, 2], "num_table_rows": 4}}
"""What the test changes in the page's config: the tiny model and sizes it runs in a few minutes."""


def page_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of docs/your-task.md, in order."""
    return [(lang, textwrap.dedent(text)) for lang, text in FENCE.findall(PAGE.read_text())]


def follow_page(workdir, tiny_server) -> str:
    """Do what the page says in ``workdir``: write each file block (``# path`` first line), run each bash block but
    ``make ui`` (a server). The config is given the tiny model and server before the flow runs. Returns the flow's
    output."""
    (workdir / ".venv").symlink_to(REPO_ROOT / ".venv")
    (workdir / "flows").symlink_to(REPO_ROOT / "flows")
    env = flow_env(METAFLOW_FEAT_ALWAYS_UPLOAD_CODE_PACKAGE="1")  # the local run records its code package
    env.pop("PYTHONPATH", None)
    out = ""
    for lang, text in page_blocks():
        first = text.splitlines()[0]
        if lang in ("python", "yaml") and first.startswith("# my-task/"):
            path = workdir / first[2:].strip()
            path.write_text(text)
            if path.suffix == ".yaml":
                config = yaml.safe_load(text)
                for section, values in TINY.items():
                    config.setdefault(section, {}).update(values)
                path.write_text(yaml.safe_dump(on_server(config, tiny_server)))
        elif lang == "bash" and not first.startswith("make ui"):
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=workdir, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1500)
            out += proc.stdout
            assert proc.returncode == 0, f"{text}\n{proc.stdout[-12000:]}"
    return out


def test_the_pages_task_trains_evaluates_and_registers_with_its_module_in_the_code_package(tmp_path, tiny_server):
    out = follow_page(tmp_path, tiny_server)
    assert not (REPO_ROOT / "my_rewards.py").exists() and "my_rewards" not in os.environ.get("PYTHONPATH", "")
    # the probe's line per reward: the module's reward gave each reference 1 and each wrong answer 0
    assert "[rewards] my_rewards:exact_minutes: reference/wrong answer per probed row 1/0, 1/0, 1/0" in out
    assert "[rewards] answer_format: reference/wrong answer per probed row 1/1, 1/1, 1/1" in out
    (version,) = model_versions(tmp_path, "minutes-policy")
    with flow_client(tmp_path) as flow:
        run = flow.latest_run
        assert run.successful
        metrics = run["evaluate"].task.data.eval_report["trained"]["metrics"]
        assert "accuracy" in metrics and "reward/my_rewards:exact_minutes" in metrics
        run_version = run["register"].task.data.model_version
        # Metaflow's code package of the run, read back from the datastore (registered with the later steps' tasks)
        code = next(step.task.code for step in run if step.task.code is not None)
        tar = code.tarball
        shipped = [m for m in tar.getmembers() if m.name.rsplit("/", 1)[-1] == "my_rewards.py"]
        assert len(shipped) == 1, sorted(m.name for m in tar.getmembers())[:60]
        text = tar.extractfile(shipped[0]).read().decode()
    assert text == (tmp_path / "my-task" / "my_rewards.py").read_text()
    # the README's Python snippet, as root with no other user name (a container), in the run's directory
    (snippet,) = [text for lang, text in FENCE.findall((REPO_ROOT / "README.md").read_text()) if lang == "python"]
    env = {k: v for k, v in flow_env().items() if k not in ("METAFLOW_USER", "SUDO_USER", "USERNAME")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(snippet) + "print(run.data.model_version)"],
                          cwd=tmp_path, env={**env, "USER": "root"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(run_version) in proc.stdout and str(version.version) in str(run_version)


BROKEN = '''
from rewards.answers import answer_accuracy


def strings_only(completions, answer, **kwargs):
    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]


def one_score(completions, **kwargs):
    return [1.0]


def partial(completions, **kwargs):
    return [0.9 * s for s in answer_accuracy(completions, **kwargs)]
'''


def test_broken_rewards_are_refused_before_any_server_in_one_block_naming_each_fix(tmp_path, tiny_model_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "broken_rewards.py").write_text(BROKEN)
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["rewards"] = [{"name": f"broken_rewards:{name}"} for name in ("strings_only", "one_score", "partial")]
    config["eval"].update(correctness_reward="broken_rewards:partial", format_reward=None)
    path = tmp_path / "tasks" / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(path), "run"], cwd=tmp_path,
                          env=flow_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    out = proc.stdout
    assert proc.returncode != 0
    assert "Run refused: a reward breaks TRL's reward contract" in out, out[-6000:]
    assert "Traceback" not in out and "Internal error" not in out, out[-6000:]
    assert "provision_vllm" not in out and "[vllm] serving" not in out  # no server was started
    assert ("reward 'broken_rewards:strings_only' probed on row 0" in out and "raised AttributeError: 'list' object "
            "has no attribute 'strip'" in out and "rewards.extract.completion_text(completion)" in out)
    assert ("reward 'broken_rewards:one_score' probed on row 0" in out and "returned 1 values for 3 completions: "
            "return a list with one score per completion" in out)
    assert ("eval.correctness_reward 'broken_rewards:partial' gave the reference answer of row 0" in out
            and "0.9: less than eval.correct_at (1)" in out and "set eval.correct_at to the score" in out)
    assert model_versions(tmp_path, config["registry"]["model_name"]) == []


def test_a_module_on_pythonpath_only_is_refused_for_a_kubernetes_run_saying_how_to_ship_it(tmp_path):
    elsewhere, here = tmp_path / "lib", tmp_path / "run"
    elsewhere.mkdir(), here.mkdir()
    (elsewhere / "far_rewards.py").write_text("def score(completions, **kw):\n    return [0.0] * len(completions)\n")
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["rewards"] = [{"name": "far_rewards:score"}]
    config["eval"].update(correctness_reward="far_rewards:score", format_reward=None)
    path = here / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**flow_env(), "PYTHONPATH": str(elsewhere)}
    proc = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(path), "run", "--with", "kubernetes"],
                          cwd=here, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode != 0
    assert "Run refused: a module the steps cannot import" in proc.stdout, proc.stdout[-4000:]
    assert f"far_rewards ({elsewhere / 'far_rewards.py'})" in proc.stdout
    assert "put the module beside the config file or in the working directory" in proc.stdout
    assert "Traceback" not in proc.stdout and "Workflow starting" not in proc.stdout
