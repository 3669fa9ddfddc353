"""A run's generation server(s) from provisioning to teardown: provisioned for this run (its owner process and run id,
:func:`provision`), kept or replaced after ``@retry`` and ``resume`` (:func:`ensure_server`), warmed up while the
training process starts (:func:`warm_up`), stopped at ``end`` (:func:`stop`) or by a failed run's exit hook
(:func:`teardown_failed_run`). The one module of :mod:`grpo_steps.servers` that knows about Metaflow runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from typing import Any

from grpo_steps import servers
from grpo_steps.config import PipelineConfig
from grpo_steps.processes import locked_record, open_private, private_dir, read_private
from grpo_steps.redaction import redact
from grpo_steps.servers import teacher as teacher_server

REPLACEMENTS_DIR = "grpo-vllm-servers"
"""Name of this user's private directory (under the temporary directory) of the replacement records."""


def provision(cfg: PipelineConfig, model_path: str) -> dict:
    """Start (or reach) the generation server of ``generation.provider`` for this run; returns its
    handle as a dict (see :mod:`grpo_steps.servers`). The server also serves evaluation, so every
    backend needs one. Raises ``ServerStartError``."""
    server = servers.provision(cfg, model_path, owner=run_owner(), run_id=metaflow_run_id())
    print(redact(f"[vllm] serving {server.summary()}"), flush=True)
    return record_capabilities(server).to_dict()


def record_capabilities(server):
    """``server`` (a :class:`~grpo_steps.servers.GenerationServer`, frozen) with what it can do, asked once, in its
    handle (:attr:`~grpo_steps.servers.GenerationServer.capabilities`): the training process and evaluation read it
    there instead of asking again. A server that cannot answer (no dev routes) keeps an empty record, printed: its
    clients then ask when they need to and fail there with its error."""
    import dataclasses

    from grpo_steps.servers.client import GenerationServerError

    try:
        capabilities = server.client().probe_capabilities()
    except GenerationServerError as err:
        print(redact(f"[vllm] could not ask {server.summary()} what it can do: {err}"), flush=True)
        return server
    print(f"[vllm] capabilities: {capabilities}", flush=True)
    return dataclasses.replace(server, capabilities=capabilities)


def ensure_server(cfg: PipelineConfig, server: dict, model_path: str) -> dict:
    """``server`` if this run can go on using it (:meth:`~grpo_steps.servers.GenerationServer.serves`),
    else a newly provisioned one, once per run.

    After a ``resume`` a ``local`` server belongs to the earlier (dead) runtime and stops itself within
    ``orphan_grace_s``: it is stopped now and replaced. The nodes of a local ``@parallel`` gang all take
    the replacement the first of them started (a second server would get no weight pushes, and the join
    could not merge two ``server`` values). A ``kubernetes`` server is kept while its Deployment is ready.

    Raises:
        GenerationServerError: an ``external`` server is not answering (the pipeline cannot start it).
    """
    from grpo_steps.servers.client import GenerationServerError

    current, owner = servers.from_dict(server), run_owner()
    if current.serves(owner):
        return server
    if not current.replaceable:
        raise GenerationServerError(f"{current} is not answering: start it again, then `resume` the run")
    with _shared_replacement(f"{metaflow_run_id()}-{owner.pid}") as record:
        if record.exists():  # read as a regular file of this user, never through a link or from a FIFO
            replacement = servers.from_dict(json.loads(read_private(record)))
            if replacement.serves(owner):
                return replacement.to_dict()
        current.stop()
        print(f"{current} belongs to an earlier run or is not answering: starting a new one", flush=True)
        replacement = provision(cfg, model_path)
        # before the record is opened (a failed dump leaves no empty record); a replica set's handle keeps its
        # capabilities as the frozen type, written as its fields (servers.from_dict reads them back)
        text = json.dumps(replacement, default=dataclasses.asdict)
        with open_private(record, "w") as out:
            out.write(text)
        return replacement


@contextmanager
def _shared_replacement(key: str):
    """Exclusive lock for the server that replaces a stale one in a run (``key``: run id and the
    runtime's PID); yields the file that records the replacement. The nodes of a local gang run on this
    machine under one runtime, so they all compute the same key. Both live in this user's private directory
    (:func:`grpo_steps.processes.private_dir`): a record another user planted is never trusted, a planted link never
    followed."""
    with locked_record(private_dir(REPLACEMENTS_DIR), key) as record:
        yield record


WARM_UP_IDS = list(range(100, 116))
"""Token ids of the warm-up requests (any ids of the vocabulary: what is computed is not used)."""


def warm_up(server: dict):
    """Ask the generation server, in a background thread while the training process starts (imports and model load,
    ~30 s on 2 cores), what the first weight push asks first, and return the thread: its config (vLLM builds the
    answer's system part once, ``collect_env``: 5.5 s in make run on 2 cores, then cached by the server;
    :meth:`grpo_steps.servers.client.VLLMClient.has_transfer_engine`), one prompt-logprobs request (the push's
    probe) and one short completion, the server's first requests of each kind being its slowest. A failure is printed,
    not raised: the training process asks again and fails there with the server's error."""
    import threading

    from grpo_steps.servers.client import GenerationServerError

    def ask() -> None:
        client = servers.from_dict(server).client()
        try:
            client.server_config()
            client.prompt_logprobs(WARM_UP_IDS)
            client.complete([WARM_UP_IDS], 2, max_tokens=8, temperature=1.0)
        except GenerationServerError as err:
            print(f"[vllm] warm-up request failed: {err}", flush=True)

    thread = threading.Thread(target=ask, name="server-warm-up", daemon=True)
    thread.start()
    return thread


def ensure_teacher(cfg: PipelineConfig, handle: dict, previous: dict | None, teacher_path) -> dict:
    """``handle`` (the generation server's) with the teacher's server of ``teacher:`` in it
    (:mod:`grpo_steps.servers.teacher`): the one recorded in ``previous`` (an earlier handle) while this run can go on
    using it, else a new one for ``teacher_path()`` (a callable, resolved only when a server starts), the stale one
    stopped. ``handle`` as it is without ``teacher:``.

    Raises:
        ServerStartError: the teacher's server did not start, or an ``external`` one does not answer.
        GenerationServerError: it does not answer a scoring request (prompt logprobs of :data:`WARM_UP_IDS`).
    """
    if cfg.teacher is None:
        return handle
    current, owner = teacher_server.of(previous), run_owner()
    if current is not None and current.serves(owner):
        return teacher_server.attach(handle, current)
    if current is not None:
        current.stop()
        print(f"[teacher] {current} belongs to an earlier run or is not answering: starting a new one", flush=True)
    teacher = teacher_server.start(cfg, teacher_path(), owner=owner)
    # the request training sends, once: a teacher that does not score sequences fails here, not at the first step
    # (and its first request, the slowest, is made before training waits on it)
    try:
        teacher.client(timeout_s=cfg.teacher.server_settings(cfg.generation.server).startup_timeout_s) \
            .sequence_logprobs([WARM_UP_IDS])
    except Exception:
        teacher.stop()  # a local teacher that cannot score is not left running until its orphan grace
        raise
    print(redact(f"[teacher] serving {teacher.summary()} (frozen: no weight pushes)"), flush=True)
    return teacher_server.attach(handle, teacher)


def stop(server: dict | None) -> None:
    """Stop the server of handle ``server`` and the teacher's in it if this run started them (an ``external`` one
    keeps running)."""
    if server:
        servers.from_dict(server).stop()
        teacher = teacher_server.of(server)
        if teacher is not None:
            teacher.stop()


def teardown_failed_run(run: Any) -> None:
    """``@exit_hook(on_error=...)`` on Argo: stop the server of a failed run, if it had one."""
    if run is None or "provision_vllm" not in run:
        return
    handle = run["provision_vllm"].task.data.server
    for server in (servers.from_dict(handle), teacher_server.of(handle)):
        if server is not None:
            print(f"stopped {server}: {server.stop()}")


def metaflow_run_id() -> str:
    """The current Metaflow run id (labels the run's Kubernetes objects); ``local`` outside a flow."""
    from metaflow import current

    return str(current.run_id) if current.is_running_flow else "local"


def run_owner():
    """The process that owns the run's servers: the Metaflow runtime, the parent of this task.

    On the local runtime the other nodes of a ``@parallel`` gang are children of node 0's task
    (``MF_PARALLEL_NODE_INDEX`` > 0): their owner is the grandparent, so they keep node 0's server.
    Returns a :class:`grpo_steps.processes.ProcessRef`.
    """
    import psutil

    from grpo_steps.processes import ProcessRef

    parent = psutil.Process().parent()
    if os.environ.get("MF_PARALLEL_NODE_INDEX", "0") != "0":
        parent = parent.parent()
    return ProcessRef(parent.pid, parent.create_time())
