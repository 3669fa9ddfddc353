"""The ``vllm serve`` flags every server the pipeline samples from or pushes weights to is started with (``local``,
``kubernetes``; an ``external`` server is checked for them): the worker extension and weight-transfer engine that
load pushed weights, the logprobs mode the mismatch correction needs, and the token-in/token-out route that says which
weight version sampled each token. Strings only: the servers' launchers, the client and the checks share them.
"""

from __future__ import annotations

LOGPROBS_MODE = "processed_logprobs"
"""``--logprobs-mode`` of every server rollouts come from: vLLM then returns the logprob of each sampled token under
the distribution it sampled from (after temperature, penalties, min-p, top-k/top-p), as TRL's mismatch correction and
the first-batch check need; vLLM's default (``raw_logprobs``) is the model's before any of them."""
WORKER_EXTENSION = "grpo_steps.vllm_worker.WorkerExtension"
"""The ``--worker-extension-cls`` of the servers this pipeline starts (:mod:`grpo_steps.vllm_worker`: weight loading
on CPU, the idle-spin limit, the weight-transfer engine's registration)."""
WEIGHT_TRANSFER_BACKEND = "grpo_steps"
"""The ``--weight-transfer-config`` backend of those servers: :class:`grpo_steps.vllm_worker.PipelineTransferEngine`
(registered under this name when the worker imports :data:`WORKER_EXTENSION`'s module)."""


def weight_transfer_args() -> list[str]:
    """The ``vllm serve`` arguments that make a server load pushed weights through :data:`WEIGHT_TRANSFER_BACKEND`
    (with ``--worker-extension-cls`` :data:`WORKER_EXTENSION`, which registers it)."""
    import json

    return ["--worker-extension-cls", WORKER_EXTENSION,
            "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND})]


TOKEN_GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in/token-out sampling route (``vllm/entrypoints/scale_out/token_in_token_out``): each choice carries
its token ids, their logprobs and ``weight_versions``, the spans of output tokens each weight version sampled (what a
weight update in flight needs); served when ``vllm serve`` runs with :data:`TOKEN_GENERATE_ARGS`."""
TOKEN_GENERATE_ARGS = ["--enable-scale-out"]
"""The ``vllm serve`` arguments that serve :data:`TOKEN_GENERATE_PATH` (behind the run's token like every route)."""
