"""Credentials anywhere in the config tree, found in ``start`` (the :class:`~grpo_steps.config.PipelineConfig`
validator ``_no_credentials_in_the_tree``) and refused naming the environment variable to use instead.

Why refuse rather than redact: Metaflow stores the parsed config (the ``config`` artifact, the code package's
config file) and the training job file carries it, as given; only a config without credentials keeps them out of
every copy. The rule is one for the whole tree, options and passthroughs included (``rewards[].options``,
``train.grpo``, ``data.task_options``, ``data.few_shot``): a non-empty value under a secret name
(:func:`grpo_steps.redaction.secret_name`: ``hub_token``, ``apiKey``, ``SECRET_ACCESS_KEY``; any type), and any
string holding URL userinfo, a secret URL parameter (``?token=``, ``X-Amz-Signature``, SAS ``sig``), a secret
flag, a well-known token shape (:func:`grpo_steps.redaction.credential_in`), or a whole value shaped as a bare key
(:func:`grpo_steps.redaction.bare_key`: 40 hex digits, an AWS secret access key).
"""

from __future__ import annotations

from typing import Any

from grpo_steps.redaction import bare_key, credential_in, holds_a_value, secret_name

VARIABLE_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("hub_token", "hf_token"), "HF_TOKEN"),
    (("tracking",), "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for an MLflow "
                    "server, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for S3"),
    (("generation.server",), "GRPO_SERVER_TOKEN (or VLLM_API_KEY for a server behind vLLM's --api-key)"),
    (("model.", "data."), "HF_TOKEN for the Hugging Face Hub, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for S3"),
    (("rewards", "tools", "environment"), "an environment variable the function reads itself (os.environ)"),
)
"""Where a credential was found -> the environment variable(s) to use instead (first match of a path part)."""


def variable_hint(path: str) -> str:
    """The environment variable(s) that replace a credential found at ``path`` (``rewards[0].options.api_key``).

    >>> variable_hint("train.grpo.hub_token"), variable_hint("rewards[1].options.key")
    ('HF_TOKEN', 'an environment variable the function reads itself (os.environ)')
    """
    for parts, hint in VARIABLE_HINTS:
        if any(part in path for part in parts):
            return hint
    return "an environment variable read by the code that needs it"


def find_credentials(tree: Any, path: str = "") -> list[tuple[str, str]]:
    """``(path, what)`` for every credential in a config dump (``model_dump(mode="json")``), ``what`` never the
    value itself: ``"a value under a secret name"`` or what :func:`grpo_steps.redaction.credential_in` names.

    >>> find_credentials({"rewards": [{"options": {"apiKey": 1}}], "model": {"name_or_path": "https://u:p@h/m"}})
    [('rewards[0].options.apiKey', 'a value under a secret name'), ('model.name_or_path', 'URL userinfo')]
    """
    found: list[tuple[str, str]] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and secret_name(key) and holds_a_value(value):
                found.append((where, "a value under a secret name"))
            else:
                found += find_credentials(value, where)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found += find_credentials(value, f"{path}[{i}]")
    elif isinstance(tree, str) and (what := credential_in(tree) or bare_key(path.rpartition(".")[2], tree)):
        found.append((path, what))
    return found


def credentials_error(found: list[tuple[str, str]]) -> str:
    """The refusal for :func:`find_credentials`' findings: each path, what it holds, the variable to use."""
    return "; ".join(f"{where} holds a credential ({what}): remove it from the config and set it in the environment "
                     f"instead: {variable_hint(where)}" for where, what in found) + (
        " (the config is stored by Metaflow, written into job files and logged to MLflow as given)")
