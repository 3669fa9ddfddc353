"""The files of ``disk`` weight pushes: a push directory rewritten in place under a new name holds exactly the bytes a
fresh write would, and a file of another layout is never reused."""

import pytest
import torch

from grpo_steps.weights.files import overwrite_safetensors, write_safetensors


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
    from grpo_steps.training.generation.disk import OWNER_FILE, sync_root

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


def test_sync_dirs_on_a_shared_volume_owned_by_another_pod_are_kept(tmp_path):
    """On Kubernetes ``generation.sync_dir`` lies on a volume other pods (another run's trainer) write to: their
    processes are not visible here, so their directories are never taken for a killed run's."""
    import json
    import socket
    import subprocess
    import sys

    from grpo_steps.processes import ProcessRef
    from grpo_steps.training.generation.disk import OWNER_FILE, sync_root

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = ProcessRef.of(child.pid)  # a PID that runs nowhere on this host any more
    child.wait()
    elsewhere, here = tmp_path / "grpo-sync-other-pod", tmp_path / "grpo-sync-killed-here"
    for directory, host in ((elsewhere, "grpo-train-0-other-run"), (here, socket.gethostname())):
        directory.mkdir()
        (directory / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "started": gone.started, "host": host}))
    live = sync_root(str(tmp_path), str(tmp_path / "out"))
    assert json.loads((live / OWNER_FILE).read_text())["host"] == socket.gethostname()
    assert elsewhere.exists() and not here.exists()


# --- a full push directory: a clear error before the server loads anything, nothing half-written ---------------

class _Server:
    """The server side of pushes, reduced to what these tests check: which loads it was asked for."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def reload_weights(self, directory, direct=True, tensors_sha256=None) -> float:
        from grpo_steps.weights.files import read_safetensors
        from grpo_steps.weights.manifest import tensors_digest

        assert (directory / "model.safetensors").is_file(), "asked to load a push that is not fully written"
        assert tensors_sha256 == tensors_digest(read_safetensors(directory)), "the request names other tensors"
        self.loaded.append(directory.name)
        return 0.0

    def set_weight_version(self, version: str) -> None:
        pass


def _weights(kib: int) -> dict:
    return {"w": torch.zeros(kib * 256)}  # float32: 4 bytes each


def test_a_directory_without_room_is_a_clear_error_naming_it_the_bytes_and_the_key(small_tmpfs):
    import errno

    from grpo_steps.training.generation.disk import DiskTransport
    from grpo_steps.weights.files import NoSpaceError

    root, server = small_tmpfs(256 * 1024), _Server()
    with pytest.raises(NoSpaceError) as err:
        DiskTransport(server, root).push(_weights(512), version=3)
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert f"weight push v3 needs 524552 bytes (1 MiB) in {root}, which has 262144 bytes (0 MiB) free" in message
    assert "change generation.sync_dir" in message
    assert server.loaded == [] and list(root.iterdir()) == []  # checked before writing: nothing written, nothing loaded


def test_a_disk_that_fills_while_writing_removes_the_partial_push_and_loads_nothing(small_tmpfs, monkeypatch):
    """Another process fills the disk between the check and the write: the kernel's ENOSPC (through safetensors)
    becomes the same clear error, and the half-written directory is removed."""
    from grpo_steps.training.generation import disk as weight_sync
    from grpo_steps.weights.files import NoSpaceError

    monkeypatch.setattr(weight_sync, "require_space", lambda *args, **kwargs: None)  # the check saw room
    root, server = small_tmpfs(256 * 1024), _Server()
    with pytest.raises(NoSpaceError, match=rf"weight push v1 needs .* in {root}, which has"):
        weight_sync.DiskTransport(server, root).push(_weights(512), version=1)
    assert server.loaded == [] and list(root.iterdir()) == []


def test_a_push_rewriting_an_older_file_in_place_is_not_refused(small_tmpfs):
    """Two pushes fill the directory; the third rewrites the first's file in place, so it needs no new room."""
    from grpo_steps.training.generation.disk import DiskTransport

    root, server = small_tmpfs(700 * 1024), _Server()
    push = DiskTransport(server, root)
    for version in range(4):
        push.push(_weights(300), version)
    assert server.loaded == ["v0", "v1", "v2", "v3"]
    assert sorted(p.name for p in root.iterdir()) == ["v2", "v3"]


def test_start_warns_when_dev_shm_cannot_hold_two_pushes_and_two_checkpoints():
    """SmolLM2-135M in float32 (the embedded model, cached): pushes 2 x 513 MiB, checkpoints 2 x 1539 MiB; on
    Kubernetes with the 64 MiB default that is a warning naming the sizes and the keys; with room, none."""
    from grpo_steps.config import REPO_ROOT, load_config
    from grpo_steps.models import resolve_model
    from grpo_steps.preflight import shm_shortfall

    cfg = load_config(REPO_ROOT / "configs" / "local.yaml")
    model_path = resolve_model(cfg.model.name_or_path)

    def on_cluster(shm_mib, **generation):
        return cfg.model_copy(update={
            "resources": cfg.resources.model_copy(update={"train": cfg.resources.train.model_copy(
                update={"image": "registry.example/grpo:1", "shared_memory_mib": shm_mib})}),
            "generation": cfg.generation.model_copy(update=generation)})

    warning = shm_shortfall(on_cluster(None), model_path)
    assert warning.startswith("/dev/shm (resources.train.shared_memory_mib) is 64 MiB, less than the 4105 MiB two "
                              "weight pushes (2 x 513 MiB) and two checkpoints (2 x 1539 MiB)")
    assert "generation.sync_dir" in warning
    assert shm_shortfall(on_cluster(8192), model_path) is None
    assert "(2 x 0 MiB) and two checkpoints" in shm_shortfall(on_cluster(2048, sync_dir="/mnt/weights"), model_path)
