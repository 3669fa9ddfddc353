"""Hostile programs in the sandbox: each is contained, scores 0, is counted, and the next program still runs."""

import json
import os
import uuid
from pathlib import Path

import pytest

from rewards import guard
from rewards.code import code_execution
from rewards.sandbox import Limits, isolation, run_python

SMALL = Limits(timeout_s=3, cpu_s=3, memory_mib=512)
MARK = Path("/tmp") / f"grpo-sandbox-escape-{uuid.uuid4().hex}"
HOME_MARK = Path.home() / f"grpo-sandbox-escape-{uuid.uuid4().hex}"

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
    ("open('f.txt', 'w').write('x' * (64 * 1024 ** 2))", "failed"),  # file over RLIMIT_FSIZE (SIGXFSZ ignored)
    ("open('ok.txt', 'w').write('inside is fine')\nassert open('ok.txt').read()", "passed"),  # work dir writable
]


@pytest.fixture(autouse=True)
def secret_in_parent(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")


@pytest.mark.parametrize(("program", "status"), HOSTILE_CASES,  # ids without the random paths: the same in
                         ids=[f"case{i:02d}-{status}" for i, (_, status) in enumerate(HOSTILE_CASES)])  # every worker
def test_hostile_program_is_contained(program, status):
    result = run_python(program, SMALL)
    assert result.status == status, result.stderr_tail
    assert result.seconds < SMALL.timeout_s + 2
    assert not MARK.exists() and not HOME_MARK.exists()
    assert run_python("assert sum(range(4)) == 6", SMALL).status == "passed"  # the next program still runs


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


def test_work_dir_is_removed_and_environment_is_minimal():
    program = "import json, os, sys\nsys.stderr.write(json.dumps([os.getcwd(), sorted(os.environ)]) + '\\n')\nassert 0"
    result = run_python(program, SMALL)
    cwd, env = json.loads(result.stderr_tail.splitlines()[0])
    assert not os.path.exists(cwd)
    assert set(env) <= {"PATH", "LC_CTYPE"}  # LC_CTYPE: Python's own locale coercion (PEP 538)


def test_isolation_is_reported():
    assert isolation() in ("netns+nobody+audit", "audit")
