"""The generation server's per-run token (grpo_steps.servers.auth): the ASGI middleware's decisions, table by table,
and where the token is kept. The real server refusing its routes: tests/integration/test_server_rollouts.py."""

import asyncio
import os
import stat

import pytest

from grpo_steps.servers import auth

TOKEN = "run-token-for-tests"

CASES = [
    ("GET", "/health", {}, 200),  # probes need no token
    ("POST", "/health", {}, 401),  # ... only GET
    ("POST", "/collective_rpc", {}, 401),  # a control route without the token
    ("POST", "/collective_rpc", {"authorization": f"Bearer {TOKEN}"}, 200),  # with it
    ("POST", "/collective_rpc", {"authorization": f"bearer {TOKEN}"}, 200),  # the scheme is case-insensitive
    ("POST", "/collective_rpc", {"authorization": "Bearer wrong"}, 401),  # another token
    ("POST", "/collective_rpc", {"authorization": f"Basic {TOKEN}"}, 401),  # another scheme
    ("POST", "/pause", {"authorization": f"Bearer {TOKEN}x"}, 401),  # a longer token
    ("GET", "/health/../collective_rpc", {}, 401),  # not the health path
    ("POST", "/v1/load_lora_adapter", {}, 401),  # LoRA loading
    ("GET", "/metrics", {}, 401),  # everything else too
]


def _call(middleware, method: str, path: str, headers: dict) -> int:
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(middleware(app)(scope, None, send))
    return sent[0]["status"]


@pytest.mark.parametrize(("method", "path", "headers", "status"), CASES)
def test_middleware(monkeypatch, method, path, headers, status):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    assert _call(auth.RunTokenMiddleware, method, path, headers) == status


def test_middleware_refuses_to_start_without_a_token(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=auth.TOKEN_ENV):
        auth.RunTokenMiddleware(lambda *a: None)


def test_a_saved_token_is_private_found_by_endpoint_and_forgotten(monkeypatch, tmp_path):
    monkeypatch.setattr(auth, "TOKEN_DIR", tmp_path / "tokens")
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    path = auth.save_token("http://127.0.0.1:8123", TOKEN)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert auth.auth_headers("http://127.0.0.1:8123") == {"Authorization": f"Bearer {TOKEN}"}
    assert auth.token_for("http://127.0.0.1:8124") is None  # another server: no token
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert auth.token_for("http://127.0.0.1:8124") == "vllm-key"
    auth.forget_token("http://127.0.0.1:8123")
    assert not path.exists()
