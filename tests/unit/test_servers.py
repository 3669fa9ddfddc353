"""The generation-server interface: handles round-trip through the Metaflow artifact dict for every
provider, ``external`` endpoints that do not answer or cannot take weights, the run's owner process."""

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from grpo_steps import servers
from grpo_steps.config import ConfigError, validate_config
from grpo_steps.processes import ProcessRef


def external_config(endpoint: str, startup_timeout_s: float = 2.0):
    return validate_config({"generation": {"provider": "external",
                                           "server": {"endpoint": endpoint, "startup_timeout_s": startup_timeout_s}}})


@pytest.mark.parametrize("server", [
    servers.LocalServer("http://127.0.0.1:8001", model="/m", supervisor_pid=12, supervisor_started=1.5,
                        owner_pid=3, owner_started=2.5, log_path="/tmp/vllm-8001.log"),
    servers.KubernetesServer("http://vllm-r1.ml.svc:8000", model="Qwen/Qwen2.5-1.5B", namespace="ml",
                             name="vllm-r1", run_id="r1"),
    servers.ExternalServer("http://127.0.0.1:9000", served_model="my-model"),
])
def test_every_provider_round_trips_through_its_handle(server):
    handle = server.to_dict()
    assert handle["provider"] == server.provider
    assert servers.from_dict(handle) == server
    assert servers.from_dict({**handle, "field_of_a_newer_version": 1}) == server  # unknown keys ignored
    assert server.client().model == server.served_model


def test_a_handle_without_a_known_provider_is_rejected():
    with pytest.raises(ValueError, match="provider 'nope'"):
        servers.from_dict({"provider": "nope", "endpoint": "http://127.0.0.1:1"})


def test_config_rejects_external_without_an_endpoint_and_an_endpoint_without_external():
    with pytest.raises(ConfigError, match="provider 'external' needs generation.server.endpoint"):
        validate_config({"generation": {"provider": "external"}})
    with pytest.raises(ConfigError, match="provider 'external' needs generation.server.endpoint"):
        validate_config({"generation": {"server": {"endpoint": "http://127.0.0.1:8000"}}})
    with pytest.raises(ConfigError, match="must be a base URL"):
        validate_config({"generation": {"provider": "external", "server": {"endpoint": "127.0.0.1:8000"}}})
    assert external_config("http://127.0.0.1:8000/").generation.server.endpoint == "http://127.0.0.1:8000"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_external_endpoint_that_does_not_answer_fails_within_the_startup_timeout():
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    began = time.monotonic()
    with pytest.raises(servers.ServerStartError) as err:
        servers.provision(external_config(endpoint), "", owner=ProcessRef.of(os.getpid()), run_id="r")
    assert time.monotonic() - began < 2.0 + 3.0
    assert endpoint in str(err.value) and "generation.server.startup_timeout_s" in str(err.value)


class _NoDevRoutes(BaseHTTPRequestHandler):
    """A stand-in for a vLLM server started without ``VLLM_SERVER_DEV_MODE``: healthy, models listed,
    no ``/server_info`` (the dev routes are what weight reloads need)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = {"/health": b"", "/v1/models": b'{"data": [{"id": "m"}]}'}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def test_an_external_server_without_dev_routes_is_refused_with_the_fix():
    httpd = HTTPServer(("127.0.0.1", 0), _NoDevRoutes)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(servers.ServerStartError, match="VLLM_SERVER_DEV_MODE=1"):
            servers.ExternalServer.start(external_config(f"http://127.0.0.1:{httpd.server_port}"))
    finally:
        httpd.shutdown()
        thread.join()


def test_a_dead_external_server_is_not_replaced_but_named():
    from grpo_steps.servers.client import GenerationServerError
    from grpo_steps.servers.lifecycle import ensure_server

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    cfg = external_config(endpoint)
    with pytest.raises(GenerationServerError, match=f"external generation server {endpoint}.*start it again"):
        ensure_server(cfg, servers.ExternalServer(endpoint).to_dict(), "/model")


def test_worker_nodes_of_a_local_gang_share_node_0s_server_owner(monkeypatch):
    import psutil

    from grpo_steps.servers.lifecycle import run_owner

    parent = psutil.Process().parent()
    monkeypatch.setenv("MF_PARALLEL_NODE_INDEX", "0")  # node 0: its parent is the runtime
    assert run_owner() == ProcessRef(parent.pid, parent.create_time())
    monkeypatch.setenv("MF_PARALLEL_NODE_INDEX", "1")  # node 1 is a child of node 0's task
    grandparent = parent.parent()
    assert run_owner() == ProcessRef(grandparent.pid, grandparent.create_time())
