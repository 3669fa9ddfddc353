"""The teacher's vLLM server of on-policy distillation (``teacher:``, docs/distillation.md): started (``local``) or
reached (``external``) through the same code as the policy's server, frozen (the pipeline never pushes weights to it),
stopped with the run's generation server. Its handle rides in the generation server's handle under
:data:`HANDLE_KEY`, so that every step and the training job that holds the one reaches the other.

Also :func:`tokenizer_mismatch`, the check that the teacher's tokenizer is the student's (vocabulary, token to id map,
special tokens), as NeMo-RL checks before distilling: the teacher scores the student's token ids as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import requests

from grpo_steps.processes import ProcessRef, wait_until
from grpo_steps.servers.auth import auth_headers
from grpo_steps.servers.base import GenerationServer, ServerStartError, is_healthy
from grpo_steps.servers.external import ExternalServer
from grpo_steps.servers.local import start_local

if TYPE_CHECKING:
    from grpo_steps.config import PipelineConfig

HANDLE_KEY = "teacher"
"""Key of the teacher's handle inside the generation server's handle (:func:`grpo_steps.servers.from_dict` ignores
it when it reads the policy's server)."""


def start(cfg: PipelineConfig, teacher_path: str, *, owner: ProcessRef) -> GenerationServer:
    """The teacher's server for ``teacher_path`` (a directory or Hub id, resolved by the caller).

    ``local``: :func:`grpo_steps.servers.local.start_local` with ``teacher.server`` (or ``generation.server``'s
    settings, :meth:`grpo_steps.config.TeacherConfig.server_settings`): the same supervisor, run token and flags as
    the policy's server, ``--logprobs-mode processed_logprobs`` among them. ``external``: the server at
    ``teacher.server.endpoint`` once it answers ``/health`` and lists a model.

    Raises:
        ServerStartError: the server did not start or does not answer (its log tail for ``local``).
    """
    settings = cfg.teacher.server_settings(cfg.generation.server)
    if cfg.teacher.provider == "external":
        return reach(settings.endpoint, settings.startup_timeout_s)
    return start_local(teacher_path, settings, max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype,
                       owner=owner)


def reach(endpoint: str, timeout_s: float) -> ExternalServer:
    """The external teacher at ``endpoint`` (it needs no dev routes: nothing is pushed to it).

    Raises:
        ServerStartError: no ``/health`` within ``timeout_s`` seconds, or no model on ``/v1/models``.
    """
    if not wait_until(lambda: is_healthy(endpoint), timeout_s, interval_s=1.0):
        raise ServerStartError(f"the teacher server {endpoint} (teacher.server.endpoint) did not answer GET /health "
                               f"within {timeout_s:.0f} s: start it, or correct the endpoint")
    try:
        models = requests.get(f"{endpoint}/v1/models", timeout=30, headers=auth_headers(endpoint))
    except requests.RequestException as err:
        raise ServerStartError(f"the teacher server {endpoint} stopped answering: {err}") from err
    served = [m["id"] for m in models.json().get("data", []) if m.get("parent") is None] if models.ok else []
    if not served:
        raise ServerStartError(f"the teacher server {endpoint} lists no model on GET /v1/models (HTTP "
                               f"{models.status_code}; 401: set GRPO_SERVER_TOKEN to its token)")
    return ExternalServer(endpoint, served_model=served[0], served_names=tuple(served))


def attach(handle: dict, teacher: GenerationServer | None) -> dict:
    """``handle`` (the generation server's) with the teacher's handle under :data:`HANDLE_KEY` (None: without)."""
    out = {k: v for k, v in handle.items() if k != HANDLE_KEY}
    return out if teacher is None else {**out, HANDLE_KEY: teacher.to_dict()}


def of(handle: dict | None) -> GenerationServer | None:
    """The teacher's server recorded in the generation server's ``handle``, or None."""
    from grpo_steps.servers import from_dict

    return from_dict(handle[HANDLE_KEY]) if handle and handle.get(HANDLE_KEY) else None


def tokenizer_mismatch(student, teacher) -> str | None:
    """What differs between two ``transformers`` tokenizers, or None when the teacher can score the student's ids:
    the same vocabulary size, token to id map and special tokens (NeMo-RL's check before distillation).

    >>> from tokenizers import Tokenizer, models
    >>> from transformers import PreTrainedTokenizerFast
    >>> def tok(vocab, eos="b"):
    ...     return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
    ...                                    eos_token=eos)
    >>> tokenizer_mismatch(tok({"a": 0, "b": 1}), tok({"a": 0, "b": 1})) is None
    True
    >>> tokenizer_mismatch(tok({"a": 0, "b": 1}), tok({"a": 1, "b": 0}))
    "the token to id map differs (e.g. 'a': student 0, teacher 1)"
    >>> tokenizer_mismatch(tok({"a": 0, "b": 1}), tok({"a": 0, "b": 1}, eos="a"))
    "the special tokens differ: student {'eos_token': 'b'}, teacher {'eos_token': 'a'}"
    """
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"the vocabulary sizes differ (student {len(ours)} tokens, teacher {len(theirs)})"
    differing = sorted(token for token in ours if theirs.get(token) != ours[token])
    if differing:
        token = differing[0]
        return f"the token to id map differs (e.g. {token!r}: student {ours[token]}, teacher {theirs.get(token)})"
    if student.special_tokens_map != teacher.special_tokens_map:
        return (f"the special tokens differ: student {dict(sorted(student.special_tokens_map.items()))}, teacher "
                f"{dict(sorted(teacher.special_tokens_map.items()))}")
    if student.added_tokens_decoder != teacher.added_tokens_decoder:
        return "the added tokens differ (ids or flags of added_tokens_decoder)"
    return None
