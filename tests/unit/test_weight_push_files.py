"""The files of ``disk`` weight pushes: a push directory rewritten in place under a new name holds exactly the bytes a
fresh write would, and a file of another layout is never reused."""

import pytest
import torch

from grpo_steps.weight_files import overwrite_safetensors, write_safetensors


def _state(seed: int, hidden: int = 8) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, hidden, generator=gen), "norm.weight": torch.randn(hidden, generator=gen),
            "head.bias": torch.randn(16, generator=gen).to(torch.bfloat16)}


def test_an_overwritten_push_equals_a_fresh_write(tmp_path):
    write_safetensors(_state(0), tmp_path / "v0")
    new = _state(1)
    assert overwrite_safetensors(new, tmp_path / "v0", tmp_path / "v2") == tmp_path / "v2"
    write_safetensors(new, tmp_path / "fresh")
    assert not (tmp_path / "v0").exists()
    rewritten, fresh = (tmp_path / d / "model.safetensors" for d in ("v2", "fresh"))
    assert rewritten.read_bytes() == fresh.read_bytes()


@pytest.mark.parametrize("other", [_state(1, hidden=4), {**_state(1), "extra.weight": torch.zeros(2)},
                                   {**_state(1), "norm.weight": torch.zeros(8, dtype=torch.float64)}])
def test_a_file_of_another_layout_is_removed_not_reused(tmp_path, other):
    write_safetensors(_state(0), tmp_path / "v0")
    assert overwrite_safetensors(other, tmp_path / "v0", tmp_path / "v2") is None
    assert not (tmp_path / "v0").exists() and not (tmp_path / "v2").exists()


def test_an_existing_target_is_refused(tmp_path):
    write_safetensors(_state(0), tmp_path / "v0")
    (tmp_path / "v2").mkdir()
    with pytest.raises(FileExistsError):
        overwrite_safetensors(_state(1), tmp_path / "v0", tmp_path / "v2")
    assert (tmp_path / "v0" / "model.safetensors").exists()


def test_sync_dirs_of_exited_training_processes_are_removed_others_kept(tmp_path):
    """A run killed with kill -9 leaves its push directories in /dev/shm; the next run's ``sync_root`` removes the
    ones whose recorded owner has exited and keeps a live run's and any without an owner record."""
    import json
    import os
    import subprocess
    import sys

    from grpo_steps.processes import ProcessRef
    from grpo_steps.training.weight_sync import OWNER_FILE, sync_root

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = ProcessRef.of(child.pid)
    child.wait()
    orphan, unowned = tmp_path / "grpo-sync-killed", tmp_path / "grpo-sync-starting"
    (orphan / "v3").mkdir(parents=True)
    (orphan / OWNER_FILE).write_text(json.dumps({"pid": dead.pid, "started": dead.started}))
    unowned.mkdir()
    live = sync_root(str(tmp_path), str(tmp_path / "out"))
    assert json.loads((live / OWNER_FILE).read_text())["pid"] == os.getpid()
    other = sync_root(str(tmp_path), str(tmp_path / "out"))  # a second run beside the first
    assert not orphan.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, unowned.name])
