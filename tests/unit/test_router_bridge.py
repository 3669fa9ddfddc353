"""The router the pipeline starts, against another user of the host: the real ``vllm-router`` binary in its private
network namespace behind :mod:`grpo_steps.servers.router_bridge`, in front of two stand-in workers on loopback that
record what they receive. Another user (a process running as ``nobody``) adds a worker of its own: it must get
neither a request nor the run's token, while the run's own requests reach the run's workers."""

import os
import pwd
import subprocess

import psutil
import pytest
import requests

from grpo_steps.config import validate_config
from grpo_steps.processes import ProcessRef
from grpo_steps.servers.router import requests_per_replica, start_router
from tests.json_server import JSONServer

TOKEN = "run-token-for-the-bridge-test"


class _Recorder(JSONServer):
    """A stand-in worker on 127.0.0.1 that records every request (path, headers) and answers as a replica."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(lambda path: {"model": name, "choices": []})

    def requests_but_health(self) -> list:
        return [seen for seen in self.seen if seen[1] != "/health"]


SYSTEM_PYTHON = "/usr/bin/python3"  # the other user cannot run this checkout's interpreter; the standard library serves


def _as_nobody(code: str) -> str:
    """Run ``code`` (standard library only) in a Python process of user ``nobody`` (the other user); its stdout."""
    nobody = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    done = subprocess.run([SYSTEM_PYTHON, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=drop,
                          env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists(SYSTEM_PYTHON),
                    reason="plays the other user with setuid (needs root and a system Python)")
def test_another_user_who_adds_a_worker_gets_neither_a_request_nor_the_token(tmp_path):
    workers, intruder = [_Recorder("policy@r0"), _Recorder("policy@r1")], _Recorder("policy@r0")
    cfg = validate_config({"generation": {"server": {"replicas": 2, "router": {"policy": "round_robin"},
                                                     "startup_timeout_s": 60}}})
    router = start_router(cfg, [w.url for w in workers], owner=ProcessRef.of(os.getpid()), token=TOKEN,
                          log_dir=tmp_path)
    try:
        # the other user: the admin routes, token-less and smuggled behind a health check on one connection
        out = _as_nobody(f"""
import http.client, socket
host, port = {router.endpoint!r}.removeprefix("http://").split(":")
for method, path in (("POST", "/add_worker?url={intruder.url}"), ("GET", "/workers"), ("POST", "/v1/completions")):
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, body=b'{{"model": "policy", "prompt": "hi"}}')
    print(conn.getresponse().status)
with socket.create_connection((host, int(port)), timeout=10) as sock:
    sock.sendall(b"GET /health HTTP/1.1\\r\\nhost: x\\r\\n\\r\\nPOST /add_worker?url={intruder.url} HTTP/1.1\\r\\n"
                 b"host: x\\r\\ncontent-length: 0\\r\\n\\r\\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
print(data.count(b"HTTP/1.1 "))
""")
        assert out.split() == ["401", "401", "401", "1"]  # one answer (the bridge's own health check), then closed
        headers = {"Authorization": f"Bearer {TOKEN}"}
        assert requests.post(f"{router.endpoint}/add_worker", params={"url": intruder.url}, headers=headers,
                             timeout=10).status_code == 403  # not even the token's holder adds a worker
        for _ in range(6):  # the run's own requests, with its token
            answer = requests.post(f"{router.endpoint}/v1/completions", json={"model": "policy", "prompt": [1]},
                                   headers=headers, timeout=30)
            assert answer.status_code == 200 and answer.json()["model"] in ("policy@r0", "policy@r1")
        assert intruder.seen == []
        counts = requests_per_replica(router.metrics_endpoint)  # the router's metrics, relayed out of its namespace
        assert {url: counts.get(url) for url in (w.url for w in workers)} == {w.url: 3.0 for w in workers}
        assert all(len(w.requests_but_health()) == 3 for w in workers)  # round robin over the run's two workers
        assert all(seen[2].get("authorization") == f"Bearer {TOKEN}" for w in workers
                   for seen in w.requests_but_health())
        # the router (and the namespace's keeper) live in a network namespace of their own: nothing on this host's
        # network reaches the router's port; only the bridge, which listens at router.endpoint, is on the host's
        tree = psutil.Process(router.supervisor_pid).children(recursive=True)
        (bridge,) = psutil.Process(router.supervisor_pid).children()
        inside = bridge.children(recursive=True)
        assert len(inside) == 2 and any(p.name().startswith("vllm") for p in inside)  # the keeper, vllm::router
        assert {os.readlink(f"/proc/{p.pid}/ns/net") for p in inside} != {os.readlink("/proc/self/ns/net")}
        assert os.readlink(f"/proc/{bridge.pid}/ns/net") == os.readlink("/proc/self/ns/net")
    finally:
        router.stop()
    assert not any(p.is_running() for p in tree)
