"""Paths the pipeline keeps in shared directories (the temporary directory, ``/dev/shm``) against another user of the
host: per-user private directories, files never opened through a planted link, records read only from regular files
of this user, and an orphan sweep that neither hangs on a FIFO nor touches another user's directory. Real files,
links, FIFOs and ownership (the tests run as root: a directory chowned to ``nobody`` plays the other user)."""

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from grpo_steps.processes import (
    OWNER_FILE,
    UnsafePathError,
    locked_record,
    open_private,
    private_dir,
    read_private,
    remove_orphan_dirs,
)
from grpo_steps.servers import ServerStartError
from grpo_steps.servers.local import start_local

NOBODY = pwd.getpwnam("nobody").pw_uid
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="plays another user with chown (needs root)")


def _in_time(call, timeout_s: float = 10.0):
    """``call()``'s result, failing the test instead of hanging when it blocks (a FIFO)."""
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as err:  # handed to the test's thread
            out.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive(), f"{call} blocked for {timeout_s} s"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def test_a_private_dir_is_per_user_0700_and_made_private_again(tmp_path):
    folder = private_dir("grpo-vllm-logs", tmp_path)
    assert folder == tmp_path / f"grpo-vllm-logs-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    folder.chmod(0o777)  # widened (an older run, a umask)
    assert private_dir("grpo-vllm-logs", tmp_path) == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_planted_link_or_file_at_the_private_name_is_refused_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.mkdir()
    (tmp_path / f"grpo-vllm-servers-{os.getuid()}").symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        private_dir("grpo-vllm-servers", tmp_path)
    (tmp_path / f"grpo-vllm-logs-{os.getuid()}").write_text("")
    with pytest.raises(UnsafePathError, match="not a directory"):
        private_dir("grpo-vllm-logs", tmp_path)


@needs_root
def test_another_users_directory_at_the_private_name_is_refused(tmp_path):
    planted = tmp_path / f"grpo-vllm-servers-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=f"belongs to uid {NOBODY}"):
        private_dir("grpo-vllm-servers", tmp_path)


@needs_root
def test_user_b_gets_its_own_directory_where_user_a_made_one_first():
    shared = Path(tempfile.mkdtemp(prefix="grpo-test-shared-"))  # in the real temporary directory: nobody can reach it
    try:
        shared.chmod(0o1777)  # as /tmp
        mine = private_dir("grpo-vllm-logs", shared)
        code = (f"from grpo_steps.processes import private_dir; import os; os.setgid({NOBODY}); os.setuid({NOBODY}); "
                f"print(private_dir('grpo-vllm-logs', {str(shared)!r}))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        theirs = shared / f"grpo-vllm-logs-{NOBODY}"
        assert done.stdout.strip() == str(theirs) and theirs.stat().st_uid == NOBODY and mine.stat().st_uid == 0
    finally:
        shutil.rmtree(shared)


def test_a_planted_link_is_never_appended_to_nor_truncated(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "vllm-8000.log").symlink_to(victim)
    with pytest.raises(UnsafePathError):
        open_private(tmp_path / "vllm-8000.log", "ab")
    (tmp_path / "run.lock").symlink_to(victim)
    with pytest.raises(UnsafePathError), locked_record(tmp_path, "run"):
        pass
    assert victim.read_text() == "precious\n"


def test_a_fifo_at_a_files_name_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "run.lock")
    with pytest.raises(UnsafePathError):
        _in_time(lambda: open_private(tmp_path / "run.lock", "ab"))
    os.mkfifo(tmp_path / "run.json")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        _in_time(lambda: read_private(tmp_path / "run.json"))


def test_a_record_is_read_only_when_small_and_ours(tmp_path):
    with locked_record(tmp_path, "run") as record, open_private(record, "w") as file:
        file.write('{"endpoint": "http://127.0.0.1:1"}')
    assert json.loads(read_private(tmp_path / "run.json")) == {"endpoint": "http://127.0.0.1:1"}
    (tmp_path / "big.json").write_text("x" * 5000)
    with pytest.raises(UnsafePathError, match="longer than 4096"):
        read_private(tmp_path / "big.json", limit_bytes=4096)
    if os.getuid() == 0:
        os.chown(tmp_path / "run.json", NOBODY, NOBODY)  # a record another user planted
        with pytest.raises(UnsafePathError, match="belongs to uid"):
            read_private(tmp_path / "run.json")


def _dead_owner_dir(parent, name):
    folder = parent / name
    folder.mkdir()
    (folder / OWNER_FILE).write_text(json.dumps({"pid": 2**22 - 1, "started": 1.0}))  # no such process
    return folder


def test_the_orphan_sweep_skips_fifos_links_and_other_users_directories(tmp_path):
    removed_ok = _dead_owner_dir(tmp_path, "grpo-scratch-mine")
    fifo_dir = tmp_path / "grpo-scratch-fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / OWNER_FILE)  # hung every later train step on main
    elsewhere = _dead_owner_dir(tmp_path, "not-swept")
    (tmp_path / "grpo-scratch-link").symlink_to(elsewhere)
    theirs = _dead_owner_dir(tmp_path, "grpo-scratch-theirs")
    if os.getuid() == 0:
        os.chown(theirs, NOBODY, NOBODY)
        os.chown(theirs / OWNER_FILE, NOBODY, NOBODY)
    removed = _in_time(lambda: remove_orphan_dirs(tmp_path, "grpo-scratch-"))
    assert removed == [removed_ok]
    assert fifo_dir.exists() and elsewhere.exists() and (tmp_path / "grpo-scratch-link").is_symlink()
    assert theirs.exists() == (os.getuid() == 0)


def test_a_server_log_planted_as_a_link_is_refused_before_anything_starts(tmp_path):
    from grpo_steps.config import ServerConfig
    from grpo_steps.processes import ProcessRef, pick_port

    port = pick_port("127.0.0.1", 0)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / f"vllm-{port}.log").symlink_to(victim)
    with pytest.raises((UnsafePathError, ServerStartError)):
        start_local("/nonexistent-model", ServerConfig(port=port, startup_timeout_s=5), max_model_len=64,
                    dtype="float32", owner=ProcessRef.of(os.getpid()), log_dir=tmp_path)
    assert victim.read_text() == "precious\n"
