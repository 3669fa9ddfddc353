"""The run's token goes to a loopback port only when the listener there is this user's (grpo_steps/loopback.py,
through the generation client's connections), and a server that has answered once is never reconnected to: whoever
binds its port after it is gone receives nothing. Real listeners: ours, and one of another user (uid 65534)."""

import os
import socket
import subprocess
import threading
import time

import pytest

from grpo_steps import loopback
from grpo_steps.servers.client import GenerationServerError, VLLMClient
from tests.json_server import JSONServer

TOKEN = "run-token-for-the-loopback-test"
OTHER_UID = 65534  # nobody


class _Squatter:
    """A listener on ``127.0.0.1:port`` that records every byte any connection sends it (run as uid ``uid`` in a
    process of its own, else in a thread of this process)."""

    CODE = ("import socket, sys, threading\n"
            "s = socket.create_server(('127.0.0.1', int(sys.argv[1])))\n"
            "print('up', flush=True)\n"
            "def read(c):\n"
            "    while data := c.recv(65536):\n"
            "        print(data, flush=True)\n"
            "while True:\n"
            "    threading.Thread(target=read, args=(s.accept()[0],), daemon=True).start()\n")

    def __init__(self, port: int, uid: int | None = None) -> None:
        def drop() -> None:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)

        self.proc = subprocess.Popen(["/usr/bin/python3", "-c", self.CODE, str(port)], stdout=subprocess.PIPE,
                                     text=True, preexec_fn=drop, env={"PATH": "/usr/bin:/bin"}, cwd="/")
        assert self.proc.stdout.readline() == "up\n"

    def received(self) -> str:
        self.proc.terminate()
        return self.proc.communicate(timeout=30)[0]


def _client(url: str) -> VLLMClient:
    return VLLMClient(url, timeout_s=10)


def test_the_token_reaches_a_listener_of_ours(monkeypatch):
    monkeypatch.setenv("GRPO_SERVER_TOKEN", TOKEN)
    server = JSONServer(lambda path: {"vllm_config": {}})
    try:
        assert _client(server.url).server_config() == {}
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as sock:
            assert loopback.peer_uid(sock) == os.getuid()
    finally:
        server.shutdown()
    assert server.seen[0][2]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="plays the other user with setuid (needs root and a system Python)")
def test_the_token_never_reaches_another_users_listener(monkeypatch):
    """Another user holds the port a replica had: the client refuses before sending a byte, and says why."""
    monkeypatch.setenv("GRPO_SERVER_TOKEN", TOKEN)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    squatter = _Squatter(port, uid=OTHER_UID)
    try:
        with pytest.raises(GenerationServerError, match=f"served by uid {OTHER_UID}, not by this user"):
            _client(f"http://127.0.0.1:{port}").server_config()
        with socket.create_connection(("127.0.0.1", port)) as sock, pytest.raises(loopback.ForeignListenerError):
            loopback.check_ours(sock, "the squatter")
    finally:
        received = squatter.received()
    assert received == ""  # not a byte: no request head, no token


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_a_server_that_answered_once_is_not_reconnected_to_when_gone(monkeypatch):
    """The server answers, then is gone; a listener (ours, so the owner check passes) takes its port 0.3 s after the
    next request finds it refused. The client's connection retries (0, 1 and 2 s after a refusal) once reached it
    with the request and the token; now the request fails at once and the port's new holder gets nothing."""
    monkeypatch.setenv("GRPO_SERVER_TOKEN", TOKEN)
    server = JSONServer(lambda path: {"vllm_config": {}})
    port = server.server_address[1]
    client = _client(server.url)
    client.server_config()
    server.shutdown()
    server.server_close()
    squatter: list[_Squatter] = []
    later = threading.Timer(0.3, lambda: squatter.append(_Squatter(port)))
    later.start()
    try:
        with pytest.raises(GenerationServerError, match="unreachable"):
            client.server_config()
    finally:
        later.join()
        time.sleep(2.5)  # past the old retries' back-off (0.5 s x 2^n): a retry would have arrived by now
        received = squatter[0].received()
    assert received == ""
