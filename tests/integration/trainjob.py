"""Training jobs for tests that run the training entry point in-process against the session's tiny vLLM server
(``tiny_server``): configs/test.yaml with overrides, and the per-step log a run leaves."""

import json

from grpo_steps.config import REPO_ROOT, load_config, validate_config
from grpo_steps.data import prepare
from grpo_steps.training.job import TrainJob


def job(tmp_path, tiny_model_path, tiny_tokenizer, endpoint, mlflow_run_id=None, **overrides) -> TrainJob:
    """A job of configs/test.yaml (3 steps, no checkpoint) with ``overrides``: ``train``, ``generation`` and
    ``resources`` update their section, any other key replaces its section (``rewards``, ``eval``, ...)."""
    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    base["train"].update({"max_steps": 3, "save_steps": 100, **overrides.pop("train", {})})
    base["generation"].update({"sync_dir": str(tmp_path / "sync"), **overrides.pop("generation", {})})
    base["resources"]["train"].update(overrides.pop("resources", {}).get("train", {}))
    base.update(overrides)  # whole sections: rewards, eval, tracking
    cfg = validate_config(base)
    rows = prepare(cfg.data, tiny_tokenizer, cfg.generation.chat_template_kwargs).train
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TrainJob(config=cfg, model_path=tiny_model_path, train_file=str(train_file),
                    output_dir=str(tmp_path / "out"), server=external(endpoint), mlflow_run_id=mlflow_run_id)


def external(endpoint: str | None) -> dict | None:
    """The handle of the server at ``endpoint`` as a job carries it (:attr:`TrainJob.server`), None without one."""
    return None if endpoint is None else {"provider": "external", "endpoint": endpoint}


def history(tmp_path) -> list[dict]:
    """The trainer's per-step logs of the job's run (the entries with a reward)."""
    return [h for h in json.loads((tmp_path / "out" / "log_history.json").read_text()) if "reward" in h]


def signal_on_process_0(completions, **_) -> list[float]:
    """A reward by rank: 1 for the first completion of process 0's share of the batch, 0 everywhere else, so that
    process 0's first group has signal and every other group has none (replay on one process only)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return [float(rank == 0 and i == 0) for i in range(len(completions))]
