"""Faults during training, then a run that continues. On the local datastore, with the ``local`` provider's whole
lifecycle in one flow run: the generation server killed (``@retry`` continues on a new server), the retried
training process SIGKILLed mid-save of a checkpoint (the next ``@retry`` continues from the newest checkpoint whose
save completed), then kill -9 of the last attempt's training process after a checkpoint; a new run started from the
killed run's checkpoint by ``train.resume_from`` continues at its step, older checkpoints pruned to
``train.save_total_limit``, no server left behind. One flow run carries several faults because each whole flow costs
minutes in ``make test``. (The S3 datastore across an S3 outage, killed and resumed: tests/integration/
test_multinode_local.py's gang; an asynchronous run resumed: tests/integration/test_async_training.py.)"""

import os
import re
import signal
import time

import pytest

from grpo_steps.processes import ProcessRef, wait_until
from tests.integration.flowrun import (
    SAVED,
    SAVING,
    SERVING,
    checkpoint_steps,
    flow_config,
    flow_env,
    flow_run_id,
    metric_steps,
    mlflow_runs,
    model_versions,
    on_server,
    run_config,
    vllm_child,
)

MAX_STEPS, SAVE_STEPS, KILL_AFTER, KEEP = 8, 2, 6, 2
MODEL_NAME = "grpo-resume-test"


def _config() -> dict:
    return flow_config(train={"max_steps": MAX_STEPS, "save_steps": SAVE_STEPS, "save_total_limit": KEEP,
                              "retries": 0},
                       registry={"model_name": MODEL_NAME})


class ServerAndTrainerFaults:
    """The faults of the local run's first attempts, by the PIDs they report: kill -9 of the generation server after
    checkpoint 2 (its train attempt fails naming it, ``@retry`` continues on a new server from step 2), then SIGKILL of
    the retried training process while it saves checkpoint 4, as the OOM killer would (the next ``@retry`` continues
    from 4 if that save completed, else from 2). Records every server's supervisor (alive when seen: its create
    time), each completed save as (training pid, step) and every line it saw (both runs, in order)."""

    def __init__(self) -> None:
        self.servers, self.supervisors, self.server_killed, self.trainer_killed, self.saved = [], [], [], [], set()
        self.lines, self.endpoints = [], []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        serving = SERVING.search(line)
        if serving:  # a server's supervisor (a router and its replicas would each be on the line)
            pids = [int(pid) for pid in re.findall(r"supervisor_pid=(\d+)", line)]
            self.servers.append(pids)
            self.endpoints.append(serving.group(1))
            self.supervisors.extend(ProcessRef.of(pid) for pid in pids)  # alive now: their create times
        match = SAVED.search(line)
        if match:
            self.saved.add((int(match.group(2)), int(match.group(1))))
        if match and int(match.group(1)) == 2 and not self.server_killed:
            child = vllm_child(self.servers[0][0])
            os.killpg(child, signal.SIGKILL)  # the vLLM server leads its own process group
            self.server_killed.append(child)
        match = SAVING.search(line)
        if match and int(match.group(1)) == 4 and self.server_killed and not self.trainer_killed:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the retried training process, mid-save of checkpoint 4
            self.trainer_killed.append(int(match.group(2)))


@pytest.mark.slow
def test_faults_then_kill_then_a_new_run_from_its_checkpoint_on_the_local_datastore(tmp_path, tiny_server):
    """With the ``local`` provider and ``train.retries: 2``: the server killed (attempt 0), the retried
    trainer killed mid-save (attempt 1), the last attempt's trainer killed after checkpoint KILL_AFTER (attempt 2, no
    retry left: the run fails), no server left behind; then a new run started from the killed run's
    newest checkpoint by ``train.resume_from`` finishes the training (on the session's server). (``resume`` after a
    kill: the S3 test below, test_flow.py's kill in evaluate, the gang's and LoRA's tests.) The rollouts come from a
    server whose sampler moved on, so the losses are not compared here: ``test_multinode_local`` compares them on
    recorded completions (backend recorded). One server: two replicas behind the router, their pushes, counts and a
    killed replica named are tests/integration/test_replicas.py's (two more vLLM starts here cost ~80 s of a worker)."""
    env, faults = flow_env(), ServerAndTrainerFaults()
    config = _config()
    config["train"]["retries"] = 2

    killed = []

    def kill_after_checkpoint(line: str) -> None:
        faults(line)
        match = SAVED.search(line)
        if match and int(match.group(1)) == KILL_AFTER and not killed:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the last attempt's training process, by its PID
            killed.append(int(match.group(2)))

    code, out = run_config(tmp_path, env, config, kill_after_checkpoint)
    owner_gone = time.monotonic()  # the killed run's runtime, which owned its servers, has exited
    assert killed and code != 0, out[-5000:]
    origin = flow_run_id(out)
    assert faults.server_killed and faults.trainer_killed
    assert f"vLLM server {faults.endpoints[0]} unreachable" in out  # attempt 0's failure names the killed server
    assert "resuming from this task's step 2 (retry)" in out  # attempt 1: the newest checkpoint of node 0
    # the kill raced the upload of checkpoint 4: attempt 2 starts from 4 if that save completed, else from 2
    newest = 4 if (faults.trainer_killed[0], 4) in faults.saved else 2
    before_last_retry, last_retry = out.rsplit("resuming from this task's step", 1)
    assert last_retry.startswith(f" {newest} (retry)"), out[-8000:]
    # attempts 1 and 2 failed saying what killed them
    assert "was killed (signal 9), likely out of memory: peak resident memory" in before_last_retry
    assert "was killed (signal 9), likely out of memory: peak resident memory" in last_retry
    assert f"removed step={KILL_AFTER - KEEP * SAVE_STEPS}" in out  # retention: older checkpoints deleted
    (killed_run,) = mlflow_runs(tmp_path)
    assert killed_run.info.status == "FAILED"  # the exit hook ended it: train failed with its retries used up
    assert checkpoint_steps(tmp_path, env, origin) == list(range(KILL_AFTER - (KEEP - 1) * SAVE_STEPS,
                                                                 KILL_AFTER + 1, SAVE_STEPS))
    assert list((tmp_path / ".metaflow" / "mf.checkpoints").rglob("*")), "checkpoints in the local datastore"
    # the first server, then @retry's replacement (the killed run's servers: each stopped below)
    assert [len(pids) for pids in faults.servers] == [1, 1], faults.servers

    # a new run from the killed run's newest checkpoint, named in the config. On the session's server: a third local
    # server would check nothing the two above did not (and cost ~40 s of a worker)
    config = on_server(_config(), tiny_server)
    config["train"]["resume_from"] = f"GRPOFlow/{origin}"
    code, started = run_config(tmp_path, env, config)
    assert code == 0, started[-6000:]
    assert f"resuming from step {KILL_AFTER} of run GRPOFlow/{origin}" in started
    assert "(retry)" not in started and "was killed" not in started
    newest_run = mlflow_runs(tmp_path)[-1]
    assert newest_run.info.status == "FINISHED"
    for metric in ("reward", "loss"):  # the new run's history continues at the checkpoint's step
        assert metric_steps(tmp_path, metric, newest_run.info.run_id) == list(range(KILL_AFTER + 1, MAX_STEPS + 1))
    assert metric_steps(tmp_path, "train_runtime", newest_run.info.run_id) == [MAX_STEPS]
    assert "eval/trained/pass_at_1" in newest_run.data.metrics
    (version,) = model_versions(tmp_path, MODEL_NAME)  # the killed run registered nothing
    assert version.run_id == newest_run.info.run_id
    assert checkpoint_steps(tmp_path, env, flow_run_id(started)) == list(range(KILL_AFTER + SAVE_STEPS, MAX_STEPS + 1,
                                                                               SAVE_STEPS))
    # the killed run's servers: each supervisor stops its server once the runtime that owned it is gone, within
    # generation.server.orphan_grace_s (60 s by default; the run above can take less), plus the supervisor's own bound
    # (grpo_steps/servers/supervisor.py: 1 s polls, 15 s for vLLM to exit on SIGTERM, 5 s for the rest of its log)
    grace_left = owner_gone + 60 + 30 - time.monotonic()
    assert wait_until(lambda: not any(s.is_running() for s in faults.supervisors), timeout_s=max(grace_left, 0)), \
        "a server outlived the killed run by more than generation.server.orphan_grace_s"
