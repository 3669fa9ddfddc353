"""A per-run secret on the generation server's routes: the control routes (``/collective_rpc``, ``/pause``,
``/update_weight_version``, LoRA loading) and generation answer only the pipeline's client.

vLLM's own ``--api-key`` guards only ``/v1``-style paths, not the dev-mode routes the pipeline needs; so the
servers this pipeline starts load :class:`RunTokenMiddleware` (``--middleware``, an ASGI class), which refuses
every request without ``Authorization: Bearer <token>`` except ``GET /health`` (liveness probes). The token
travels in the process variables (:data:`TOKEN_ENV`), never on a command line, in a log or an artifact:

- ``local`` provider: a fresh token per server (or ``GRPO_SERVER_TOKEN`` / ``VLLM_API_KEY`` when the flow's
  process variables set one: what its clients present), in the server's process variables and in a file only this
  user can read (``~/.cache/grpo-pipeline/server-tokens/<host>-<port>``, mode 0600), where the run's clients find it
  by endpoint (:func:`token_for`); removed when the server stops.
- ``external``: start the server with ``--middleware grpo_steps.servers.auth.RunTokenMiddleware`` and
  ``GRPO_SERVER_TOKEN`` in its process variables, and run the flow with the same ``GRPO_SERVER_TOKEN``
  (``VLLM_API_KEY`` is sent when ``GRPO_SERVER_TOKEN`` is not set, for a server behind vLLM's own key).
- ``kubernetes``: a NetworkPolicy admits only the run's pods (``infra/k8s/vllm-server.yaml``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import urllib.parse
from pathlib import Path

TOKEN_ENV = "GRPO_SERVER_TOKEN"
"""Environment variable holding the server's token (server side: the middleware; client side: the flow)."""
MIDDLEWARE = "grpo_steps.servers.auth.RunTokenMiddleware"
"""The ``--middleware`` value of the servers the pipeline starts."""
TOKEN_DIR = Path.home() / ".cache" / "grpo-pipeline" / "server-tokens"
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the token (GET only)."""


def new_token() -> str:
    """A fresh random token (32 bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def _token_file(endpoint: str) -> Path:
    parts = urllib.parse.urlsplit(endpoint)
    return TOKEN_DIR / f"{parts.hostname}-{parts.port}"


def save_token(endpoint: str, token: str) -> Path:
    """Keep ``token`` for the clients of the server at ``endpoint`` (a file readable by this user only)."""
    TOKEN_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(TOKEN_DIR, 0o700)
    path = _token_file(endpoint)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token)
    return path


def forget_token(endpoint: str) -> None:
    """Remove the saved token of the server at ``endpoint`` (it stopped)."""
    _token_file(endpoint).unlink(missing_ok=True)


def token_for(endpoint: str) -> str | None:
    """The token a client presents to ``endpoint``: ``GRPO_SERVER_TOKEN``, else the token a local server saved
    for that endpoint, else ``VLLM_API_KEY``; None when there is none (a server without authentication)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = _token_file(endpoint)
    if path.is_file():
        return path.read_text().strip()
    return os.environ.get("VLLM_API_KEY") or None


def auth_headers(endpoint: str) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` for ``endpoint`` (see :func:`token_for`), or ``{}``."""
    token = token_for(endpoint)
    return {"Authorization": f"Bearer {token}"} if token else {}


class RunTokenMiddleware:
    """Pure ASGI middleware: every HTTP or websocket request but ``GET /health`` must carry
    ``Authorization: Bearer <GRPO_SERVER_TOKEN>``, else 401. Loaded by vLLM's ``--middleware`` (no arguments).

    Raises:
        RuntimeError: at start-up, when ``GRPO_SERVER_TOKEN`` is not set (the server would be open).
    """

    def __init__(self, app) -> None:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise RuntimeError(f"{MIDDLEWARE} needs {TOKEN_ENV} in the server's environment")
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(given.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)  # lifespan events
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (path in OPEN_PATHS and scope.get("method") == "GET") or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": "unauthorized: the run\'s token is required"}'})
