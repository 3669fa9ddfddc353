"""The training entry point on its own (no Metaflow, no server): the ``hf`` generation backend."""

import json

import pytest

from grpo_steps.config import REPO_ROOT, load_config, validate_config
from grpo_steps.data import prepare
from grpo_steps.training.entry import run
from grpo_steps.training.job import TrainJob

pytestmark = pytest.mark.slow


def test_hf_backend_trains_and_writes_the_final_policy(tmp_path, tiny_model_path, tiny_tokenizer):
    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    base["generation"]["backend"] = "hf"
    base["train"].update(max_steps=2, save_steps=1)
    cfg = validate_config(base)
    rows = prepare(cfg.data, tiny_tokenizer).train
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = run(TrainJob(config=cfg, model_path=tiny_model_path, train_file=str(train_file),
                         output_dir=str(tmp_path / "out")))
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()
    assert final.endswith("final")
    history = json.loads((tmp_path / "out" / "log_history.json").read_text())
    assert [h["step"] for h in history if "reward" in h] == [1, 2]
    assert all("weight_sync/seconds" not in h for h in history)  # no server, no sync
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
