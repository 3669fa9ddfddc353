"""Continual post-training (docs/continual.md) at test sizes: three real flow runs in a row on one MLflow store, on the
session's tiny server (provider ``external``), with ``data.skip_seen`` over a file of 12 rows (4 held out, 4 per run):

1. from the tiny base model: registers version 1, which a person then makes ``champion``. The gate cannot pass
   honestly here: it moves ``champion`` only when the whole 95 % interval of the pass@1 gain lies above
   ``registry.min_improvement``, which the config keeps in 0..1 (a negative margin would let a worse policy through),
   and a tiny random policy's gain over 4 prompts after 2 steps is noise around zero. So the gate is set never to pass
   (``min_improvement: 1.0``: an interval's lower bound never exceeds 1) and the alias moves as a reviewer moves it;
   the gate's own moves are tests/unit/test_gate.py's;
2. from ``models:/grpo-continual@champion``: starts from version 1 (tags, fetched files, digest). Its training process
   is killed after checkpoint 1; meanwhile ``champion`` is taken away and the fetched version deleted (a new machine),
   and ``resume`` continues from step 1 of the same pinned version 1 (fetched again, by digest), not from whatever
   ``@champion`` names now. Its baseline is version 1 (greedy accuracy equal to run 1's trained policy on the same
   held-out prompts), it trains only on the 4 rows the chain has not seen, and registers version 2 with parent
   version 1 and the chain in its description; then champion is moved to version 2;
3. from ``models:/grpo-continual@champion`` again: no row is new to version 2's chain, so the run ends after
   ``prepare_data`` with one line, exit code 0, no third version, its MLflow run FINISHED."""

import json
import os
import shutil
import signal

import pytest

from grpo_steps.lineage import row_digest
from grpo_steps.versions import DIGEST_TAG, model_sha256
from tests.integration.flowrun import (
    SAVED,
    config_file,
    flow_client,
    flow_config,
    flow_env,
    flow_run_id,
    on_server,
    run_flow,
)

pytestmark = pytest.mark.slow
NAME = "grpo-continual"
START = f"models:/{NAME}@champion"


def _rows(path):
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in
            [(1, 2), (2, 3), (3, 4), (4, 1), (5, 2), (6, 1), (2, 2), (3, 1), (7, 1), (1, 1), (4, 4), (5, 3)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(workdir, server, model: str, label: str, on_line=None, **train) -> tuple[int, str]:
    """Run the flow from ``model`` (2 steps unless ``train`` overrides them); returns (exit code, output)."""
    config = on_server(flow_config(train={"max_steps": 2, "save_steps": 2, **train}), server)
    config["model"]["name_or_path"] = model
    config["data"] = {"source": "jsonl", "path": str(workdir / "rows.jsonl"), "num_train": 4, "num_eval": 4,
                      "max_prompt_tokens": 96, "skip_seen": True}
    # min_improvement 1.0: no gate can pass (a gain's lower bound never exceeds 1), so the aliases move as the test says
    config["registry"] = {"model_name": NAME, "min_eval_prompts": 2, "min_improvement": 1.0}
    config["tracking"] = {"tracking_uri": f"sqlite:///{workdir}/mlflow.db"}
    path = config_file(workdir, config, f"{label}.yaml")
    return run_flow(workdir, _env(workdir), ["--config", "config", str(path), "run"], on_line)


def _env(workdir) -> dict:
    return flow_env(GRPO_CACHE_DIR=str(workdir / "cache"))


def _succeeded(label: str, result: tuple[int, str]) -> str:
    code, out = result
    assert code == 0, f"{label} failed:\n{out[-12000:]}"
    return out


def _killed_after_checkpoint_1(workdir, server) -> str:
    """Run 2 from ``@champion`` with its training process SIGKILLed (by the PID it reports) once checkpoint 1 is
    saved, no retry left; returns its output."""
    killed = []

    def kill(line: str) -> None:
        match = SAVED.search(line)
        if match and match.group(1) == "1" and not killed:
            os.kill(int(match.group(2)), signal.SIGKILL)
            killed.append(int(match.group(2)))

    code, out = _run(workdir, server, START, "run2", kill, save_steps=1, retries=0)
    assert killed and code != 0, out[-8000:]
    return out


def test_three_runs_in_a_row_start_from_the_champion_train_on_new_rows_and_stop_when_none_are_left(
        tmp_path, tiny_server, tiny_model_path):
    from mlflow import MlflowClient

    _rows(tmp_path / "rows.jsonl")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")

    # one step is enough for version 1: the chain counts the 4 rows run 1 was given (its train split), trained or not
    out1 = _succeeded("run1", _run(tmp_path, tiny_server, tiny_model_path, "run1", max_steps=1, save_steps=1))
    (v1,) = client.search_model_versions(f"name = '{NAME}'")
    assert v1.version == 1 and "lineage.parent_version" not in v1.tags and v1.tags["lineage.rows_added"] == "4"
    assert v1.tags["lineage.rows_artifact"] == "lineage/seen_rows.json"
    assert v1.description.startswith(f"**Lineage**: v1 (pass@1 {v1.tags['eval.pass_at_1']})")
    client.set_registered_model_alias(NAME, "champion", "1")  # the reviewer's move (no gate passes at test sizes)

    out2 = _killed_after_checkpoint_1(tmp_path, tiny_server)
    assert f"[start] {START} is models:/{NAME}/1" in out2
    (fetched,) = [p for p in (tmp_path / "cache" / "registry" / NAME).glob("1-*") if p.is_dir()]
    # before resume: @champion names nothing now, and this machine has no copy of version 1 (as a new pod would)
    client.delete_registered_model_alias(NAME, "champion")
    shutil.rmtree(fetched)
    resumed = _succeeded("resume", run_flow(tmp_path, _env(tmp_path), ["resume"]))
    assert f"resuming from step 1 of run {flow_run_id(out2)}" in resumed
    assert "[start]" not in resumed  # start was not run again: the pinned version came from its tags
    assert fetched.is_dir() and model_sha256(fetched) == client.get_model_version(NAME, "1").tags[DIGEST_TAG]
    (v2,) = [v for v in client.search_model_versions(f"name = '{NAME}'") if v.version == 2]
    assert (v2.tags["lineage.parent_version"], v2.tags["lineage.parent_model"]) == ("1", NAME)
    assert v2.tags["lineage.rows_added"] == "4"
    assert v2.description.startswith(f"**Lineage**: v1 (pass@1 {v1.tags['eval.pass_at_1']}) <- v2 (pass@1 "
                                     f"{v2.tags['eval.pass_at_1']})")
    table = client.get_registered_model(NAME).description.splitlines()  # the model page: pass@1 per version
    assert table[2:] == [f"| v2 | {v2.tags['eval.pass_at_1']} | v1 | 4 | candidate |",
                         f"| v1 | {v1.tags['eval.pass_at_1']} |  | 4 |  |"]
    assert client.get_registered_model(NAME).aliases == {"candidate": 2}  # the gate held: no champion set
    assert v2.tags["gate.reason"].startswith("pass@1 gain over the baseline")
    run2 = client.get_run(v2.run_id)
    tags2 = run2.data.tags
    assert (tags2["start.model_uri"], tags2["start.model_version"]) == (f"models:/{NAME}/1", "1")
    assert (tags2["start.model_run_id"], tags2["start.model_sha256"]) == (v1.run_id, v1.tags[DIGEST_TAG])
    assert "**Start**: `models:/grpo-continual/1`" in tags2["mlflow.note.content"]  # the run's page says both
    assert "champion not set" in tags2["mlflow.note.content"]
    run1 = client.get_run(v1.run_id)
    # the baseline is version 1: greedy accuracy on the same held-out prompts equals run 1's trained policy's
    assert run2.data.metrics["eval/baseline/accuracy"] == run1.data.metrics["eval/trained/accuracy"]
    with flow_client(tmp_path) as runs:
        first, second = runs[flow_run_id(out1)], runs[flow_run_id(resumed)]
        start_dir = second["start"].task.data.model_path
        train1, eval1 = first["prepare_data"].task.data.train_rows, first["prepare_data"].task.data.eval_rows
        train2, eval2 = second["prepare_data"].task.data.train_rows, second["prepare_data"].task.data.eval_rows
    assert start_dir.startswith(str(tmp_path / "cache" / "registry" / NAME / "1-"))
    assert model_sha256(start_dir) == v1.tags[DIGEST_TAG] != model_sha256(tiny_model_path)
    digests = [{row_digest(r) for r in rows} for rows in (train1, eval1, train2, eval2)]
    assert [len(d) for d in digests] == [4, 4, 4, 4]
    assert digests[1] == digests[3]  # the same held-out rows across the chain
    assert not digests[2] & (digests[0] | digests[1])  # run 2 trained only on rows new to the chain
    with open(client.download_artifacts(v2.run_id, "lineage/seen_rows.json", str(tmp_path))) as file:
        seen = json.load(file)
    assert set(seen["trained"]) == digests[0] | digests[2] and set(seen["held_out"]) == digests[1]
    client.set_registered_model_alias(NAME, "champion", "2")

    out3 = _succeeded("run3", _run(tmp_path, tiny_server, START, "run3"))
    assert "[data] 0 rows new to the chain of models:/grpo-continual@champion" in out3
    assert "provision_vllm" not in out3 and "/train/" not in out3  # ended after prepare_data
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 2
    (run3,) = [r for r in client.search_runs([run1.info.experiment_id])
               if r.data.tags["metaflow.pathspec"] == f"GRPOFlow/{flow_run_id(out3)}"]
    assert run3.info.status == "FINISHED" and run3.data.tags["start.model_version"] == "2"
    assert run3.data.tags["mlflow.note.content"].startswith("**Ended after prepare_data**")
