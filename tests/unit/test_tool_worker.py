"""Tools that cannot hang or flood the trainer: each ``tools:`` call runs in the tool's worker process, killed at
``generation.tool_timeout_s``. A hanging, a spinning, a GIL-holding and an exiting tool each end within their
timeout with an error (an ``Exception``: TRL's tool loop turns it into the ``{"error": ...}`` tool message), and
leave no thread or process behind; a huge answer is cut to ``generation.max_tool_response_length``; completion
tables are redacted.
"""

import asyncio
import os
import textwrap
import threading
import time

import psutil
import pytest

from grpo_steps.tools.functions import tool_functions
from grpo_steps.tools.worker import TRUNCATED

TIMEOUT_S = 1.0
SLACK_S = 10.0  # start-up of the worker process on a loaded machine; the tools below would run for an hour

BODIES = {  # tool name -> body; each becomes `def name(x: int)` with a docstring (a schema, as tools need)
    "hang": "time.sleep(3600)",  # sleeps
    "spin": "while True:\n    x += 1",  # keeps a core busy
    "regex": "return int(bool(re.match(r'(a+)+$', 'a' * 64 + 'b')))",  # holds the GIL in C for a very long time
    # a child, then hangs; the child's argument names this test process (3599.<pid> s), so that another xdist
    # worker's sleeper is not taken for one this process left behind
    "spawn_and_hang": f"subprocess.Popen(['sleep', '3599.{os.getpid()}'])\ntime.sleep(3600)",
    "leave": "sys.exit(x)",
    "interrupt": "raise KeyboardInterrupt('from the tool')",
    "hard_exit": "os._exit(x)",
    "huge": "return 'x' * 21_000_000",  # a 21 MB answer
    "double": "return 2 * x",
}
TEMPLATE = ('{kind}def {name}(x: int) -> int:\n    """Tool {name}.\n\n    Args:\n        x: a number.\n    """\n'
            '{body}\n\n\n')


def _module_source() -> str:
    tools = [("", name, body) for name, body in BODIES.items()] + [("async ", "double_async", "return 2 * x")]
    return "import os, re, subprocess, sys, time\n\n\n" + "".join(
        TEMPLATE.format(kind=kind, name=name, body=textwrap.indent(body, "    ")) for kind, name, body in tools)


@pytest.fixture
def tools(tmp_path, monkeypatch):
    (tmp_path / "hostile_tools.py").write_text(_module_source())
    monkeypatch.syspath_prepend(str(tmp_path))  # for the schema check here
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the worker processes
    made = []

    def make(name, max_chars=4096):
        [fn] = tool_functions([f"hostile_tools:{name}"], TIMEOUT_S, max_chars)
        made.append(fn)
        return fn

    yield make
    for fn in made:
        fn.worker.close()


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _sleepers() -> list[int]:
    """Sleepers of this test process's ``spawn_and_hang``, wherever they are now (an orphan is no descendant)."""
    return [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", f"3599.{os.getpid()}"]]


@pytest.mark.parametrize(("name", "error", "message"), [
    ("hang", TimeoutError, "took longer than 1 s"),  # sleeps
    ("spin", TimeoutError, "took longer than 1 s"),  # keeps a core busy
    ("regex", TimeoutError, "took longer than 1 s"),  # holds the GIL (in this process it would block every thread)
    ("spawn_and_hang", TimeoutError, "took longer than 1 s"),  # its child goes with it
    ("leave", RuntimeError, "raised SystemExit: 3"),  # SystemExit is the call's error, not the trainer's exit
    ("interrupt", RuntimeError, "raised KeyboardInterrupt: from the tool"),
    ("hard_exit", RuntimeError, r"ended its process \(exit code 3\)"),
])
def test_a_hostile_tool_ends_within_its_timeout_with_an_error_and_leaves_nothing(tools, name, error, message):
    fn = tools(name)
    threads, children = threading.active_count(), _descendants()
    started = time.monotonic()
    with pytest.raises(error, match=message) as raised:
        fn(3)
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert isinstance(raised.value, Exception)  # what TRL's tool loop catches (`except Exception`: an error turn)
    fn.worker.close()  # the worker of a tool that raised is still up, for its next call
    assert threading.active_count() == threads
    assert _descendants() <= children
    assert _sleepers() == []


def test_the_worker_answers_again_after_a_kill(tools):
    fn = tools("double")
    assert fn(2) == 4
    pid = fn.worker.proc.pid
    assert fn(x=5) == 10 and fn.worker.proc.pid == pid  # one persistent process per tool
    os.kill(pid, 9)  # killed from outside (as a timeout does)
    with pytest.raises(RuntimeError, match="ended its process"):
        fn(1)
    assert fn(1) == 2  # started again


def test_the_worker_answers_again_after_it_died_before_the_call(tools):
    """The worker is gone before the call writes its request (a broken pipe, not a silent end): the call fails
    naming the ended process, and the next call starts a new worker."""
    fn = tools("double")
    assert fn(2) == 4
    os.kill(fn.worker.proc.pid, 9)
    fn.worker.proc.wait()  # dead for sure: the request's write meets a closed pipe
    with pytest.raises(RuntimeError, match="ended its process"):
        fn(1)
    assert fn(1) == 2


def test_an_async_tool_runs_in_its_worker(tools):
    fn = tools("double_async")
    assert asyncio.iscoroutinefunction(fn)
    assert asyncio.run(fn(3)) == 6


def test_a_huge_answer_is_cut_before_it_leaves_the_worker(tools):
    fn = tools("huge", max_chars=1000)
    answer = fn(0)
    assert answer == "x" * 1000 + TRUNCATED


def test_completion_tables_are_redacted(tmp_path, mlflow_db):
    import mlflow

    from grpo_steps import tracking

    client = mlflow.MlflowClient(tracking_uri=mlflow_db)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "art"))).info.run_id
    secret = "hf_" + "A" * 30
    tracking.log_table(client, run_id, {"completion": [f"tool lookup: token={secret}", "fine"], "reward": [1.0, 0.0]},
                       "completions/step_000001.json")
    logged = (tmp_path / "art" / run_id / "artifacts" / "completions" / "step_000001.json").read_text()
    assert secret not in logged and "fine" in logged


def test_a_module_a_tool_wrote_into_the_working_directory_never_shadows_the_standard_library(tmp_path, monkeypatch):
    marker = tmp_path / "shadowed"
    (tmp_path / "json.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nraise ImportError('shadow')\n")
    (tmp_path / "cwd_tools.py").write_text(TEMPLATE.format(kind="", name="triple", body="    return 3 * x"))
    monkeypatch.chdir(tmp_path)  # a tool module beside the run still imports (after the standard library)
    monkeypatch.syspath_prepend(str(tmp_path))  # for the schema check here
    monkeypatch.delenv("PYTHONPATH", raising=False)
    [fn] = tool_functions(["cwd_tools:triple"], 30.0, 4096)
    try:
        assert fn(2) == 6
    finally:
        fn.worker.close()
    assert not marker.exists()  # on main the worker (python -m, the cwd first) imported the planted json.py


def test_the_worker_finds_the_pipeline_in_its_code_root(tmp_path):
    """A worker puts :data:`CODE_ROOT` on its path to import ``grpo_steps`` where no package is installed (a Metaflow
    task's unpacked code package): it is the directory holding the package, and a bare interpreter started from
    elsewhere, with nothing but that directory added, imports the worker's module from it."""
    import subprocess
    import sys
    from pathlib import Path

    from grpo_steps.tools.worker import CODE_ROOT

    assert (Path(CODE_ROOT) / "grpo_steps" / "tools" / "worker.py").is_file()
    boot = f"import sys; sys.path.append({CODE_ROOT!r}); import grpo_steps.tools.worker as w; print(w.__file__)"
    out = subprocess.run([sys.executable, "-P", "-S", "-c", boot], cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert Path(out.strip()) == Path(CODE_ROOT) / "grpo_steps" / "tools" / "worker.py"
