"""The reward contract probe (grpo_steps/reward_probe.py) and where a reward's module is found (rewards/locate.py):
each kind of broken reward refused with the function, the row and the fix; a working one described in one line."""

import os
import re
import sys
import textwrap

import pytest

from grpo_steps.config import validate_config
from grpo_steps.config.pipeline import config_file_of_command, with_module_dirs
from grpo_steps.reward_probe import RewardContractError, probe_rewards

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "answer": str(i + 2)} for i in range(4)]


class Chars:
    """A stand-in tokenizer: one id per character (the probe only needs ``completion_ids`` of the right shape)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _config(tmp_path, module: str, **eval_keys):
    """A config naming ``mine_<test>:score`` (and answer_format), with ``module`` as ``mine_<test>.py`` beside it (a
    name per test: every test's directory stays on ``sys.path``)."""
    tmp_path.mkdir(exist_ok=True)
    name = "mine_" + re.sub(r"\W", "_", str(tmp_path.relative_to(tmp_path.parent.parent)))
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(module))
    data = {"rewards": [{"name": f"{name}:score"}, {"name": "answer_format", "weight": 0.5}],
            "eval": {"correctness_reward": f"{name}:score", **eval_keys}}
    return validate_config(with_module_dirs(data, tmp_path / "run.yaml"))


def test_a_working_reward_beside_the_config_is_found_and_described_per_probe(tmp_path):
    cfg = _config(tmp_path, """
        from rewards.extract import completion_text, extract_answer

        def score(completions, answer, **kwargs):
            assert isinstance(kwargs["prompts"][0], list) and "completion_ids" in kwargs  # TRL's call
            return [float(extract_answer(completion_text(c)) == a) for c, a in zip(completions, answer)]
        """)
    assert cfg.module_dirs[0] == str(tmp_path)  # the config's directory first
    lines = probe_rewards(cfg, ROWS, Chars())
    assert lines[0].endswith(":score: reference/wrong answer per probed row 1/0, 1/0, 1/0")
    assert lines[1] == "[rewards] answer_format: reference/wrong answer per probed row 1/1, 1/1, 1/1"
    assert "written as 'Answer: {answer}'" in lines[2]


@pytest.mark.parametrize(("module", "message"), [
    # written for strings: TRL passes message lists
    ("def score(completions, answer, **kw):\n"
     "    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]",
     "raised AttributeError: 'list' object has no attribute 'strip'. TRL passes completions as conversational message "
     "lists"),
    ("def score(completions, **kw):\n    return [1.0]", "returned 1 values for 3 completions: return a list with one "
                                                         "score per completion"),
    ("def score(completions, **kw):\n    return ['1'] * len(completions)", "gave row 0 ('What is 0 + 2?') the "
                                                                           "reference answer '1' (str)"),
    # a score in [0, 1): never counted correct at the default eval.correct_at 1.0
    ("from rewards.answers import answer_accuracy\n"
     "def score(completions, **kw):\n    return [0.9 * s for s in answer_accuracy(completions, **kw)]",
     "gave the reference answer of row 0 ('What is 0 + 2?', answer '2'), written as 'Answer: 2', 0.9: less than "
     "eval.correct_at (1)"),
    ("def score(completions, **kw):\n    return [1.0] * len(completions)",
     "gave a wrong answer of row 0 ('What is 0 + 2?', answer '2') 1, as much as the reference answer (1)"),
])
def test_a_broken_reward_is_refused_naming_it_the_row_and_the_fix(tmp_path, module, message):
    cfg = _config(tmp_path, module)
    with pytest.raises(RewardContractError) as refused:
        probe_rewards(cfg, ROWS, Chars())
    assert message in str(refused.value) and ":score'" in str(refused.value)


def test_a_lower_correct_at_accepts_a_reward_scoring_below_one(tmp_path):
    cfg = _config(tmp_path, """
        from rewards.answers import answer_accuracy

        def score(completions, **kw):
            return [0.9 * s for s in answer_accuracy(completions, **kw)]
        """, correct_at=0.9)
    assert "0.9/0" in probe_rewards(cfg, ROWS, Chars())[0]


def test_a_module_in_the_working_directory_is_found_after_the_config_directory(tmp_path, monkeypatch):
    here, there = tmp_path / "cwd", tmp_path / "configs"
    here.mkdir(), there.mkdir()
    (here / "cwd_only_rewards.py").write_text("def score(completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(here)
    data = with_module_dirs({"rewards": [{"name": "cwd_only_rewards:score"}]}, there / "run.yaml")
    assert data["module_dirs"] == [str(there), str(here)]
    assert validate_config(data).rewards[0].name == "cwd_only_rewards:score"
    index = sys.path.index(str(there))
    assert sys.path[index + 1] == str(here)  # config directory, then working directory
    assert index > max(i for i, p in enumerate(sys.path) if p.endswith("site-packages"))  # after installed packages
    # a file named like an installed package beside the config shadows it no more (it did in every main process)
    import importlib.util

    (there / "idna.py").write_text("raise SystemExit('the shadow ran')\n")
    assert not importlib.util.find_spec("idna").origin.startswith(str(there))


def test_an_unknown_module_names_where_it_was_looked_for(tmp_path):
    with pytest.raises(Exception) as refused:
        validate_config(with_module_dirs({"rewards": [{"name": "nowhere_rewards:score"}]}, tmp_path / "run.yaml"))
    assert "No module named 'nowhere_rewards' in " in str(refused.value) and str(tmp_path) in str(refused.value)
    assert "a module beside the config file, in the working directory or installed" in str(refused.value)


def test_a_reward_module_that_does_not_compile_is_refused_naming_its_file_and_line(tmp_path):
    """A syntax error in the user's reward module: a one-line refusal of the config (it once ended in a raw
    traceback through Metaflow's command line)."""
    with pytest.raises(Exception) as refused:
        _config(tmp_path, "def score(completions, **kw):\n    return [1.0 for c in completions\n")
    module = next(tmp_path.glob("mine_*.py"))
    assert f"its module does not compile, SyntaxError at {module}:2" in str(refused.value)
    assert f"Fix that line (python -m py_compile {module} checks the file)" in str(refused.value)


def test_the_config_file_is_taken_from_metaflows_option_before_the_command():
    assert config_file_of_command(["flow.py", "--config", "config", "/x/my.yaml", "run"]).as_posix() == "/x/my.yaml"
    assert config_file_of_command(["flow.py", "run"]).name == "local.yaml"  # the flow's default


@pytest.mark.parametrize(("correct_at", "accuracy", "pass_at_1"), [(1.0, 0.0, 0.0), (0.9, 0.5, 0.25)])
def test_eval_correct_at_is_the_score_accuracy_pass_at_k_and_the_gate_count_as_correct(correct_at, accuracy,
                                                                                        pass_at_1):
    """A correctness reward scoring a right answer 0.9: nothing is correct at the default 1.0, everything it scores
    0.9 is at correct_at 0.9 (per_prompt's pass@1 is the gate's metric)."""
    from grpo_steps.evaluation.policy import per_prompt, prompt_metrics
    from grpo_steps.evaluation.scoring import Scores

    cfg = validate_config({"eval": {"correct_at": correct_at, "num_samples": 2, "k": [1, 2]}})
    scores = Scores(sampled={"answer_accuracy": [[0.9, 0.0], [0.0, 0.0]], "answer_format": [[1.0, 1.0], [1.0, 1.0]]},
                    greedy={"answer_accuracy": [[0.9], [0.0]], "answer_format": [[1.0], [1.0]]},
                    weights={"answer_accuracy": 1.0, "answer_format": 0.5}, guard={})
    metrics = prompt_metrics(cfg, 2, scores, [[3, 3], [3, 3]], [0, 1])
    assert (metrics["accuracy"], metrics["pass@1"]) == (accuracy, pass_at_1)
    assert per_prompt(cfg, scores)["pass@1"] == [2 * pass_at_1, 0.0]


def test_a_tool_beside_the_config_runs_in_its_own_worker_process(tmp_path):
    """The tool worker (a fresh interpreter, ``python -P``) searches the config's module directories too."""
    from grpo_steps.tools.functions import tool_functions

    name = "tool_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"{name}.py").write_text(textwrap.dedent('''
        import os


        def where(x: int) -> str:
            """Which process answers, and twice x.

            Args:
                x: a number.
            """
            return f"{os.getpid()} {2 * x}"
        '''))
    cfg = validate_config(with_module_dirs({"tools": [f"{name}:where"]}, tmp_path / "run.yaml"))
    (tool,) = tool_functions(cfg.tools, 30)
    try:
        pid, doubled = tool(x=4).split()
    finally:
        tool.worker.close()
    assert doubled == "8" and int(pid) != os.getpid()


def test_user_modules_beside_the_config_are_what_the_flow_adds_to_metaflows_code_package(tmp_path):
    """A single-file module as a module, a package as its files under the code directory; the pipeline's own and
    registered rewards are not user modules (the whole-flow check reads a run's package: test_your_task.py)."""
    from metaflow.packaging_sys import ContentType

    from grpo_steps.deploy import OnKubernetes, user_modules

    tag = re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"single_{tag}.py").write_text("def score(completions, **kw):\n    return [0.0] * len(completions)\n")
    (tmp_path / f"pkg_{tag}" / "sub").mkdir(parents=True)
    (tmp_path / f"pkg_{tag}" / "__init__.py").write_text("")
    (tmp_path / f"pkg_{tag}" / "sub" / "__init__.py").write_text("")
    (tmp_path / f"pkg_{tag}" / "sub" / "tools.py").write_text(textwrap.dedent('''
        def echo(text: str) -> str:
            """Echo.

            Args:
                text: what to say.
            """
            return text
        '''))
    cfg = validate_config(with_module_dirs({"rewards": [{"name": f"single_{tag}:score"}, {"name": "answer_format"}],
                                            "tools": [f"pkg_{tag}.sub.tools:echo"],
                                            "eval": {"correctness_reward": f"single_{tag}:score"}},
                                           tmp_path / "run.yaml"))
    mutator = OnKubernetes.__new__(OnKubernetes)  # the hook alone, without a flow class to decorate
    mutator._user_modules = user_modules(cfg.model_dump(mode="json"))
    assert mutator._user_modules == [f"pkg_{tag}", f"single_{tag}"]
    shipped = list(mutator.add_to_package())
    assert (sys.modules[f"single_{tag}"], None, ContentType.MODULE_CONTENT) in shipped
    assert sorted(arc for _, arc, kind in shipped if kind == ContentType.CODE_CONTENT) == [
        f"pkg_{tag}/__init__.py", f"pkg_{tag}/sub/__init__.py", f"pkg_{tag}/sub/tools.py"]
    # a link inside the package ships its file; a link out of it (a key file beside it) is refused, naming both
    (tmp_path / f"pkg_{tag}" / "alias.py").symlink_to(tmp_path / f"pkg_{tag}" / "sub" / "tools.py")
    assert f"pkg_{tag}/alias.py" in [arc for _, arc, _ in mutator.add_to_package()]
    (tmp_path / "credentials").write_text("[default]\n")
    (tmp_path / f"pkg_{tag}" / "sub" / "keys.txt").symlink_to(tmp_path / "credentials")
    with pytest.raises(ValueError, match=r"keys.txt \(in user package 'pkg_.*'\) is a link to .*credentials, outside"):
        list(mutator.add_to_package())


def test_an_environments_adapter_prefix_is_no_module_the_code_package_looks_for(tmp_path):
    """``gym:module:Class`` ships ``module`` (beside the config); ``textarena:<id>`` names the installed textarena,
    which is neither shipped nor refused, and need not be imported where the run is launched (configs/game.yaml's
    code package failed with KeyError 'textarena' before)."""
    from metaflow.packaging_sys import ContentType

    from grpo_steps.deploy import OnKubernetes, unshipped, user_modules
    from rewards.locate import add_module_dirs, origin

    tag = re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"board_{tag}.py").write_text("class Board:\n    pass\n")
    add_module_dirs([str(tmp_path), os.getcwd()])  # the working directory holds make's .venv: installed all the same
    mutator = OnKubernetes.__new__(OnKubernetes)  # the hook alone, without a flow class to decorate
    mutator._user_modules = user_modules({"rewards": [], "tools": None, "environment": f"gym:board_{tag}:Board"})
    assert mutator._user_modules == [f"board_{tag}"] and f"board_{tag}" not in sys.modules
    ((module, arcname, kind),) = mutator.add_to_package()
    assert module is sys.modules[f"board_{tag}"] and (arcname, kind) == (None, ContentType.MODULE_CONTENT)
    games = {"play": "textarena:GuessTheNumber-v0", "other": f"gym:board_{tag}:Board"}
    mutator._user_modules = user_modules({"rewards": [], "tools": None, "environment": games})
    assert mutator._user_modules == [f"board_{tag}", "textarena"] and origin("textarena") == "installed"
    assert [arcname for _, arcname, _ in mutator.add_to_package()] == [None]  # the board module alone
    unshipped(mutator._user_modules)  # nothing refused: one shipped, one installed


def test_a_task_format_none_of_the_known_ones_is_given_by_eval_reference_format(tmp_path):
    """A reward that reads JSON answers gives every known way of writing the reference 0: refused, naming
    eval.reference_format; accepted once it says how the task writes an answer."""
    module = """
        import json
        from rewards.extract import completion_text

        def score(completions, answer, **kw):
            def stated(c):
                try:
                    return str(json.loads(completion_text(c))["answer"])
                except (ValueError, KeyError, TypeError):
                    return None
            return [float(stated(c) == a) for c, a in zip(completions, answer)]
        """
    with pytest.raises(RewardContractError, match="eval.reference_format: how your task writes an answer"):
        probe_rewards(_config(tmp_path / "a", module), ROWS, Chars())
    cfg = _config(tmp_path / "b", module, reference_format='{"answer": "{answer}"}')
    assert "1/0, 1/0, 1/0" in probe_rewards(cfg, ROWS, Chars())[0]


def test_an_async_reward_is_awaited_and_a_blocking_one_refused_within_its_timeout(tmp_path):
    """Both through the guard training uses: an ``async def`` reward (documented in docs/your-task.md) is awaited and
    probed like any other; a reward that blocks is refused once its ``timeout_s`` (1 s here) has passed, naming it,
    its file and line, and the fix (it once held ``prepare_data`` for ever)."""
    cfg = _config(tmp_path / "a", """
        import asyncio
        from rewards.extract import completion_text, extract_answer

        async def score(completions, answer, **kwargs):
            await asyncio.sleep(0)
            return [float(extract_answer(completion_text(c)) == a) for c, a in zip(completions, answer)]
        """)
    assert probe_rewards(cfg, ROWS, Chars())[0].endswith(":score: reference/wrong answer per probed row 1/0, 1/0, 1/0")
    cfg = _config(tmp_path / "b", """
        import threading

        def score(completions, **kwargs):
            threading.Event().wait(600)  # a network call without a limit of its own
            return [1.0] * len(completions)
        """)
    cfg = cfg.model_copy(update={"rewards": [spec.model_copy(update={"timeout_s": 1.0}) for spec in cfg.rewards]})
    with pytest.raises(RewardContractError) as refused:
        probe_rewards(cfg, ROWS, Chars())
    module = tmp_path / "b" / f"{cfg.rewards[0].name.split(':')[0]}.py"
    message = str(refused.value)
    assert f"reward {cfg.rewards[0].name!r} ({module}:4) gave no answer within its timeout_s (1 s)" in message
    assert "raise this reward's timeout_s" in message
