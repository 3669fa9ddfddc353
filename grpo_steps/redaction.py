"""One redaction for everything that leaves the process: MLflow params and tags, Metaflow artifacts, job files,
log lines, the card and the registered version's description.

Credentials belong in the environment (``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, ``VLLM_API_KEY``,
``GRPO_SERVER_TOKEN``, ``AWS_*``, ``HF_TOKEN``); the config refuses them inline (:func:`inline_secret`, used by
``grpo_steps.config``), and :func:`redact` replaces any that still reach a string with ``***``: the userinfo of a
URL (``https://user:pw@host`` -> ``https://***@host``), the value after a key-like command-line flag
(``--api-key KEY``, ``--hf-token=T``), ``key=value`` pairs with a secret-like key, ``Bearer`` tokens and a few
well-known token shapes (Hugging Face ``hf_...``, OpenAI-style ``sk-...``, AWS access key ids).
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
SECRET_WORDS = frozenset(("key", "apikey", "token", "secret", "password", "passwd", "pwd", "credential",
                          "credentials", "auth", "authorization"))
"""A flag or key one of whose ``-``/``_``/``.``-separated words is one of these holds a secret (``--api-key``,
``hf_token``, ``db.password``; not ``max_tokens`` or ``--tokenizer``)."""
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/\s@]+)@")
_FLAG_EQ = re.compile(r"(?P<flag>--?[A-Za-z][\w-]*)=(?P<value>\S+)")
_FLAG_SPACE = re.compile(r"(?P<flag>--?[A-Za-z][\w-]*)(?P<sep>\s+)(?P<value>(?!-)\S+)")
_PAIR = re.compile(r"(?P<key>\b[A-Za-z][\w.-]*)(?P<sep>\s*[=:]\s*)(?P<value>[^\s&,;\"']+)")
_BEARER = re.compile(r"\b(?P<scheme>Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
_TOKEN_SHAPES = re.compile(r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16})\b")


def secret_name(name: str) -> bool:
    """Whether a flag or key name names a secret (see :data:`SECRET_WORDS`).

    >>> secret_name("--api-key"), secret_name("HF_TOKEN"), secret_name("max_completion_tokens")
    (True, True, False)
    """
    return any(word in SECRET_WORDS for word in re.split(r"[-_.\s]+", name.lower()) if word)


def is_secret_flag(arg: str) -> bool:
    """Whether a command-line flag names a secret (its value, the next argument or after ``=``, is one).

    >>> is_secret_flag("--api-key"), is_secret_flag("--hf-token=x"), is_secret_flag("--max-model-len")
    (True, True, False)
    """
    name = arg.split("=", 1)[0]
    return name.startswith("-") and secret_name(name)


def redact(text: str) -> str:
    """``text`` with every credential in it replaced by ``***`` (see the module docstring).

    >>> redact("[vllm] serving https://me:s3cret@gpu.example.com:8000 --api-key KEY --port 8000")
    '[vllm] serving https://***@gpu.example.com:8000 --api-key *** --port 8000'
    >>> redact("sqlite:///mlflow.db token=abc&x=1 Authorization: Bearer eyJhbGciOi")
    'sqlite:///mlflow.db token=***&x=1 Authorization: Bearer ***'
    """
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _FLAG_EQ.sub(lambda m: f"{m['flag']}={MASK}" if secret_name(m["flag"]) else m[0], text)
    text = _FLAG_SPACE.sub(lambda m: f"{m['flag']}{m['sep']}{MASK}" if secret_name(m["flag"]) else m[0], text)
    text = _BEARER.sub(lambda m: f"{m['scheme']} {MASK}", text)
    text = _PAIR.sub(lambda m: f"{m['key']}{m['sep']}{MASK}" if secret_name(m["key"]) and m["value"] != MASK
                     and m["value"].lower() not in ("bearer", "basic", "token") else m[0], text)
    return _TOKEN_SHAPES.sub(MASK, text)


def redact_args(args: list[str]) -> list[str]:
    """A command line with the value of every secret flag (``--api-key KEY``, ``--api-key=KEY``) replaced by ``***``.

    >>> redact_args(["--api-key", "KEY", "--port", "8000", "--hf-token=T"])
    ['--api-key', '***', '--port', '8000', '--hf-token=***']
    """
    out: list[str] = []
    for i, arg in enumerate(args):
        if i and is_secret_flag(args[i - 1]) and "=" not in args[i - 1] and not arg.startswith("-"):
            out.append(MASK)
        else:
            out.append(redact(arg))
    return out


def redact_value(value: Any) -> Any:
    """``value`` (a config dump, an artifact, a handle) with every string redacted, lists of command-line
    arguments by :func:`redact_args` and dict entries under a secret-like key replaced whole."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: MASK if isinstance(k, str) and secret_name(k) and isinstance(v, str) and v else redact_value(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = redact_args(list(value)) if all(isinstance(v, str) for v in value) else [redact_value(v)
                                                                                          for v in value]
        return type(value)(items)
    return value


def inline_secret(text: str) -> str | None:
    """What credential ``text`` holds inline, or None: ``"URL userinfo"``, ``"a secret flag"``, ``"a token"``.

    >>> inline_secret("http://u:p@host"), inline_secret("--api-key=K"), inline_secret("http://host:8000")
    ('URL userinfo', 'a secret flag', None)
    """
    if _USERINFO.search(text):
        return "URL userinfo"
    if any(secret_name(m["flag"]) for m in _FLAG_EQ.finditer(text)) or is_secret_flag(text):
        return "a secret flag"
    if _BEARER.search(text) or _TOKEN_SHAPES.search(text):
        return "a token"
    return None
