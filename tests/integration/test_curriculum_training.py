"""train.curriculum through the real training entry (no server: recorded completions whose pass rates differ by
prompt): the sampler steers TRL's dataloader, its metrics reach the trainer's log, its state is in every checkpoint,
and a run resumed from a checkpoint on another gang size (one process's checkpoint continued by two DDP processes
through ``launch``, as the flow's train step starts them) trains the same prompts as the uninterrupted run."""

import json

import pytest

from grpo_steps.config import REPO_ROOT, load_config, validate_config
from grpo_steps.data import prepare
from grpo_steps.launch import launch
from grpo_steps.training.cursor import PROMPTS_LOG, prompt_id
from grpo_steps.training.entry import run
from grpo_steps.training.job import TrainJob

pytestmark = pytest.mark.slow

STEPS, KILL_AT = 8, 4


def right_answers(index: int) -> int:
    """Right completions of 4 for train row ``index``: 0 to 4, so that every pool gets prompts."""
    return index % 5


def _job(workdir, model_path, rows, recorded: str, max_steps: int, resume_from=None, tracking_uri=None,
         mlflow_run_id=None, processes: int = 1) -> TrainJob:
    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    base["tracking"]["tracking_uri"] = tracking_uri or base["tracking"]["tracking_uri"]
    base["generation"].update(backend="recorded", recorded_file=recorded)
    base["train"].update(max_steps=max_steps, save_steps=KILL_AT, save_total_limit=5,
                         curriculum={"pass_reward": "answer_accuracy"}, processes_per_node=processes,
                         # the same completions per optimizer step over all processes (2 prompts x 4)
                         per_device_train_batch_size=base["train"]["per_device_train_batch_size"] // processes)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TrainJob(config=validate_config(base), model_path=model_path, train_file=str(workdir / "train.jsonl"),
                    output_dir=str(workdir / "out"), resume_from=resume_from, mlflow_run_id=mlflow_run_id)


def _prompts(workdir) -> dict[int, list[str]]:
    lines = (workdir / "out" / PROMPTS_LOG).read_text().splitlines()
    return {entry["step"]: entry["ids"] for entry in map(json.loads, lines)}


def test_a_curriculum_resumed_on_another_gang_size_trains_the_uninterrupted_runs_prompts(
        tmp_path, tiny_model_path, tiny_tokenizer, capsys):
    rows = prepare(validate_config(load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()).data,
                   tiny_tokenizer).train
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text("".join(json.dumps({"question": r["prompt"][-1]["content"], "completions": [
        f"Answer: {r['answer']}" if k < right_answers(i) else "Answer: 1000" for k in range(4)]}) + "\n"
        for i, r in enumerate(rows)))

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("curriculum", str(tmp_path / "artifacts"))).info.run_id
    whole = tmp_path / "whole"
    run(_job(whole, tiny_model_path, rows, str(recorded), STEPS, tracking_uri=uri, mlflow_run_id=run_id))
    # seen in MLflow: every step's curriculum metrics, and the picture as a run artifact
    for name in ("pool/unseen", "pool/learnable", "drawn/unseen", "drawn_pass_rate", "zero_signal_share"):
        assert sorted(m.step for m in client.get_metric_history(run_id, f"curriculum/{name}")) == list(
            range(1, STEPS + 1)), name
    assert [a.path for a in client.list_artifacts(run_id, "curriculum")] == ["curriculum/pass_rate.png"]
    checkpoint = whole / "out" / f"checkpoint-{KILL_AT}"
    state = json.loads((checkpoint / "curriculum.json").read_text())
    assert state["next_batch"] == KILL_AT  # one generation batch per optimizer step
    logs = [h for h in json.loads((whole / "out" / "log_history.json").read_text()) if "loss" in h]
    assert len(logs) == STEPS
    pools = {name: logs[-1][f"curriculum/pool/{name}"] for name in ("unseen", "hard", "learnable", "easy")}
    assert sum(pools.values()) == len(rows) and pools["unseen"] < len(rows)
    assert all(0 <= h["curriculum/zero_signal_share"] <= 1 and "curriculum/drawn_pass_rate" in h for h in logs)
    assert (whole / "out" / "curriculum_pass_rate.png").read_bytes()[:4] == b"\x89PNG"
    # the observed pass rates are the recorded completions' (ids and rewards aligned across the gathered batch)
    index = {prompt_id(r["prompt"]): i for i, r in enumerate(rows)}
    uninterrupted = _prompts(whole)
    for h in logs:
        expected = sum(right_answers(index[p]) for p in uninterrupted[h["step"]]) / (4 * len(uninterrupted[h["step"]]))
        assert h["curriculum/drawn_pass_rate"] == pytest.approx(expected)
    assert logs[0]["curriculum/drawn/unseen"] == 1.0 and logs[0]["curriculum/pool/unseen"] == len(rows)

    # killed after step KILL_AT and resumed on another gang size: the one process's checkpoint continued by a gang of
    # two (accelerate launch, DDP over gloo), each rank loading the curriculum and drawing the same batches, which are
    # the uninterrupted run's (a resume on the same gang size: tests/unit/test_curriculum.py)
    resized = tmp_path / "resized"
    launch(_job(resized, tiny_model_path, rows, str(recorded), STEPS, resume_from=str(checkpoint), processes=2))
    assert "saved by 1 node x 1 process on 1 node x 2 processes" in capsys.readouterr().out
    after = _prompts(resized)
    assert sorted(after) == list(range(KILL_AT + 1, STEPS + 1))
    assert after == {step: uninterrupted[step] for step in after}
    state = json.loads((resized / "out" / f"checkpoint-{STEPS}" / "curriculum.json").read_text())
    assert state["next_batch"] == STEPS and state["rates"] == json.loads(
        (whole / "out" / f"checkpoint-{STEPS}" / "curriculum.json").read_text())["rates"]
