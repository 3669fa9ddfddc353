"""Bad inputs stop the flow early with a message that names the problem: before provision_vllm (no server
started, seconds) where they can be seen there (exit non-zero, the message, no server left, no model version
registered); in the training job for the two that only show while training."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime

import pytest
import yaml

from tests.integration.flowrun import FLOW, flow_config, flow_env, mlflow_runs, model_versions, run_config

pytestmark = [pytest.mark.usefixtures("tiny_model_path"), pytest.mark.slow]  # whole flows stopped early, 20-50 s


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fails_before_the_server(workdir, config: dict, message: str, env: dict | None = None,
                             mlflow_store: bool = True) -> str:
    """Run the flow on ``config``; assert it fails with ``message`` before provision_vllm. Returns the output.
    ``mlflow_store`` off: no MLflow store is put in ``workdir`` beforehand (:func:`run_flow`), for a check that the
    refused run wrote none."""
    code, out = run_config(workdir, env or flow_env(), config, mlflow_store=mlflow_store)
    assert code != 0, out[-3000:]
    assert message in out, out[-6000:]
    assert "provision_vllm" not in out and "[vllm] serving" not in out  # no server was started
    # a refusal is its message in one block (grpo_steps.preflight.refusals), not Metaflow's "Internal error" and a
    # traceback ending in it
    assert "Traceback" not in out and "Internal error" not in out, out[-6000:]
    if (workdir / "mlflow.db").exists():
        assert model_versions(workdir, config["registry"]["model_name"]) == []
    return out


def test_an_unreachable_tracking_server_fails_start_within_seconds_naming_it(tmp_path):
    uri = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    out = _fails_before_the_server(tmp_path, flow_config(tracking={"tracking_uri": uri}),
                                   f"MLflow tracking server {uri} does not answer")
    # the start step fails within 30 s of its first line (the probe gives up after 10 s; MLflow's own client
    # would retry for minutes); the whole command within 60 s (~3-4 s on an idle 2-core machine, ~28 s with
    # the cores shared by four flows)
    stamps = [datetime.fromisoformat(line[:23]) for line in out.splitlines() if "/start/1 (pid" in line]
    assert (stamps[-1] - stamps[0]).total_seconds() < 30
    assert time.monotonic() - started < 60
    assert "fix tracking.tracking_uri" in out


def test_local_replicas_that_do_not_fit_are_refused_in_start_in_one_block(tmp_path):
    """64 local replicas fit no machine this suite runs on (a core each, 8 GiB of KV cache each): start says so,
    printed as a refusal (its message), not as Metaflow's internal error with a traceback (checked by the helper)."""
    config = flow_config(generation={"server": {"replicas": 64, "kv_cache_gib": 8}})
    out = _fails_before_the_server(tmp_path, config, "ConfigError: generation.server.replicas 64")
    assert "Run refused by start's checks:" in out and "prepare_data" not in out


@pytest.mark.parametrize(("grpo", "message"), [
    # a name the reference docs teach, removed in TRL 1.16: refused when the config is read, naming its replacement
    ({"max_prompt_length": 256}, "train.grpo.max_prompt_length is not a TRL 1.16 GRPOConfig field: use "
                                 "data.max_prompt_tokens"),
    # a typo: refused in start against the installed TRL, with the closest field
    ({"num_iteration": 2}, "num_iteration (did you mean num_iterations"),
])
def test_a_train_grpo_key_trl_lacks_fails_within_seconds_naming_the_fix(tmp_path, grpo, message):
    started = time.monotonic()
    _fails_before_the_server(tmp_path, flow_config(train={"grpo": grpo}), message)
    assert time.monotonic() - started < 90  # seconds, not minutes: no data prepared, no server started


def test_too_few_rows_is_a_data_error_with_the_counts_and_the_mlflow_run_ends_failed(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(20)))
    config = flow_config(data={"source": "jsonl", "path": str(rows), "task_options": {}})
    _fails_before_the_server(tmp_path, config, "DataError: data source 'jsonl': 20 usable prompts (20 rows, "
                             "0 duplicates, 0 over data.max_prompt_tokens=96), fewer than num_train + num_eval = "
                             "16 + 8")
    (run,) = mlflow_runs(tmp_path)  # start opened it; prepare_data failed; the exit hook ended it
    assert run.info.status == "FAILED"
    assert run.info.end_time is not None


def test_a_malformed_line_is_a_data_error_naming_the_file_and_line(tmp_path):
    """One whole flow (each costs minutes of this suite's CPU); each kind of line: tests/unit/test_data.py."""
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\n1 + 1?,2\n2 + 2?,4,extra\n")
    config = flow_config(data={"source": "csv", "path": str(path), "task_options": {}})
    _fails_before_the_server(tmp_path, config, f"DataError: {path}:3: malformed csv line: 3 fields where the header "
                             "has 2")


def test_a_reward_whose_signature_cannot_take_the_call_is_rejected_before_any_step(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def score(completions, answer):\n    return [1.0] * len(completions)\n")
    env = flow_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    config = flow_config(eval={"format_reward": None, "correctness_reward": "my_rewards:score"})
    config["rewards"] = [{"name": "my_rewards:score"}]
    out = _fails_before_the_server(tmp_path, config, "reward 'my_rewards:score' has the signature (completions, "
                                   "answer); a reward must take (completions, ", env,
                                   mlflow_store=False)
    assert "add a var-keyword parameter such as" in out  # Metaflow's log drops the asterisks of **kwargs
    assert "Traceback" not in out  # a config error is one block
    assert not (tmp_path / "mlflow.db").exists()  # rejected with the config: nothing ran


def test_prepare_data_probes_an_async_reward_and_refuses_a_blocking_one_within_its_timeout(tmp_path):
    """The probe calls rewards through the training guard: the documented ``async def`` reward is awaited (it was
    refused as "returned coroutine"), and a reward that blocks is refused once its timeout_s (2 s) has passed, naming
    its file and line (it held prepare_data for ever)."""
    (tmp_path / "my_rewards.py").write_text(
        "import asyncio, threading\n"
        "from rewards.extract import completion_text, extract_answer\n"
        "async def judged(completions, answer, **kwargs):\n"
        "    await asyncio.sleep(0)\n"
        "    return [float(extract_answer(completion_text(c)) == a) for c, a in zip(completions, answer)]\n"
        "def stuck(completions, **kwargs):\n"
        "    threading.Event().wait(3600)\n"
        "    return [0.0] * len(completions)\n")
    env = flow_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    config = flow_config(eval={"format_reward": None, "correctness_reward": "my_rewards:judged"})
    config["rewards"] = [{"name": "my_rewards:judged"}, {"name": "my_rewards:stuck", "timeout_s": 2}]
    out = _fails_before_the_server(tmp_path, config, f"reward 'my_rewards:stuck' ({tmp_path / 'my_rewards.py'}:6) "
                                   "gave no answer within its timeout_s (2 s)", env)
    assert "1 of the rewards cannot be trained with" in out and "my_rewards:judged" not in out.split(
        "cannot be trained with")[1]  # the async one passed the probe


@pytest.mark.parametrize(("reference", "message"), [
    ("GRPOFlow/999999", "train.resume_from 'GRPOFlow/999999': no such run"),
    ("GRPOFlow/no-such-key/3", "train.resume_from 'GRPOFlow/no-such-key/3' is not a directory, a 'FlowName/run_id' "
                               "pathspec or a checkpoint key"),
])
def test_a_resume_from_that_names_nothing_fails_start(tmp_path, reference, message):
    out = _fails_before_the_server(tmp_path, flow_config(train={"resume_from": reference}),
                                   f"CheckpointNotFound: {message}", mlflow_store=False)
    assert "prepare_data" not in out  # checked in start, before the MLflow run is opened
    assert not (tmp_path / "mlflow.db").exists()


# --- bad inputs that only show while training: the training job on the session's server ----------------------
# Run as the train step runs them (grpo_steps.training.entry.run, a real trainer on the real tiny server), not as
# whole flows: how a train-step failure reaches the flow's output and ends its MLflow run FAILED with no version
# registered is checked by the kill/resume and replica-fault flows (tests/integration/test_resume.py).


def a_float(completions, **kwargs):
    return 1.0


def never_applies(completions, **kwargs):
    return [None] * len(completions)


def _fails_in_train(tmp_path, tiny_model_path, tiny_tokenizer, server, reward: str, error, **train) -> str:
    """Train on this module's ``reward`` alone (by its dotted path, as a user's config names it); returns the
    message of the ``error`` it must stop with."""
    from grpo_steps.training.entry import run
    from tests.integration.trainjob import job

    name = f"{__name__}:{reward}"
    with pytest.raises(error) as err:
        run(job(tmp_path, tiny_model_path, tiny_tokenizer, server.endpoint, train={"max_steps": 4, **train},
                rewards=[{"name": name}], eval={"format_reward": None, "correctness_reward": name}))
    return str(err.value)


@pytest.mark.slow
def test_a_reward_returning_a_float_stops_training_naming_the_reward(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                     tiny_server):
    from rewards.guard import RewardReturnError

    message = _fails_in_train(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server, "a_float", RewardReturnError)
    assert f"reward '{__name__}:a_float' returned 1.0 (float); a reward returns a list of 8 float or None, one " \
           "per completion" in message  # 2 prompts x 4 completions
    assert not (tmp_path / "out" / "final").exists()  # stopped at its first batch: no policy saved


@pytest.mark.slow
def test_rewards_all_none_for_steps_in_a_row_stop_the_run(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server,
                                                          capfd):
    from grpo_steps.training.callbacks import AllRewardsNone

    message = _fails_in_train(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server, "never_applies", AllRewardsNone,
                              max_all_none_steps=2)
    assert f"every reward ({__name__}:never_applies) scored None for every completion in steps 1..2 (2 in a row, " \
           "train.max_all_none_steps=2)" in message
    assert "[train] step 3/" not in capfd.readouterr().out  # stopped at the second step


def test_an_interrupted_run_ends_killed_in_mlflow(tmp_path):
    """Ctrl+C (SIGINT) to the flow's runtime while prepare_data runs: the exit hook ends the run KILLED."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(flow_config()))
    # Ctrl+C as in a terminal, also when the suite itself runs in the background (`make test &`), where the shell
    # starts every process with SIGINT ignored and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, str(FLOW), "--config", "config", "run.yaml", "run"], cwd=tmp_path,
                            env=flow_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, interrupted = [], []
    try:
        for line in proc.stdout:
            out.append(line)
            if "/prepare_data/" in line and "(pid" in line and not interrupted:
                proc.send_signal(signal.SIGINT)  # once (a second Ctrl+C cuts Metaflow's clean-up short)
                interrupted.append(line)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert interrupted and proc.returncode != 0
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "KILLED", "".join(out)[-4000:]
    assert "[vllm] serving" not in "".join(out)


def test_lora_target_modules_the_model_lacks_fail_start(tmp_path):
    config = flow_config(train={"peft": {"r": 8, "target_modules": ["q_proj", "query_key_value"]}})
    out = _fails_before_the_server(tmp_path, config, "ConfigError: train.peft.target_modules ['query_key_value'] "
                                   "are not linear layers of the model", mlflow_store=False)
    assert "prepare_data" not in out  # checked in start, before the MLflow run is opened
    assert not (tmp_path / "mlflow.db").exists()


def test_inline_credentials_are_refused_before_any_step_and_leave_no_trace(tmp_path):
    secret = "hunter2-flow-s3cr3t"
    config = flow_config(tracking={"tracking_uri": f"https://alice:{secret}@127.0.0.1:1"},
                         generation={"provider": "external",
                                     "server": {"endpoint": f"http://bob:{secret}@127.0.0.1:8000",
                                                "extra_args": ["--api-key", secret]}})
    code, out = run_config(tmp_path, flow_env(), config)
    assert code != 0
    for key in ("tracking.tracking_uri", "generation.server.endpoint", "generation.server.extra_args"):
        assert key in out, out[-3000:]
    assert "MLFLOW_TRACKING_PASSWORD" in out and "VLLM_API_KEY" in out
    assert secret not in out  # the log
    assert "start" not in {p.name for p in (tmp_path / ".metaflow").rglob("*")}  # no step ran, no config artifact
    for path in tmp_path.rglob("*"):  # the Metaflow datastore, any MLflow store: nothing but the config file
        if path.is_file() and path.name != "run.yaml":
            assert secret.encode() not in path.read_bytes(), path
