"""What a generation server can do is asked once, when it is provisioned, and kept in its handle
(:attr:`grpo_steps.servers.base.GenerationServer.capabilities`): every client built from the handle (the training
process's, evaluation's) answers from it without a request. A loopback stand-in of the test's own answers the two
questions (``/server_info``, the token route)."""

import dataclasses
import json

from grpo_steps.servers import ExternalServer, ReplicaSet, from_dict
from grpo_steps.servers.capabilities import ServerCapabilities
from grpo_steps.servers.lifecycle import record_capabilities
from grpo_steps.weights.server_flags import TOKEN_GENERATE_PATH, WEIGHT_TRANSFER_BACKEND, WORKER_EXTENSION
from tests.json_server import JSONServer

SERVER_INFO = {"vllm_config": {"parallel_config": {"worker_extension_cls": WORKER_EXTENSION},
                               "weight_transfer_config": {"backend": WEIGHT_TRANSFER_BACKEND}}}


def _questions(server: JSONServer) -> list[str]:
    return [path.split("?")[0] for _, path, _ in server.seen if path.split("?")[0] in ("/server_info",
                                                                                        TOKEN_GENERATE_PATH)]


def test_capabilities_are_asked_at_provisioning_and_read_from_the_handle_after():
    stand_in = JSONServer(lambda path: SERVER_INFO if path == "/server_info" else {"choices": []})
    try:
        handle = record_capabilities(ExternalServer(stand_in.url))
        assert handle.capabilities == ServerCapabilities(transfer_engine=True, token_route=True)
        assert handle.capabilities.in_flight  # derived from both, not recorded a second time
        assert handle.to_dict()["capabilities"] == {"transfer_engine": True, "token_route": True}
        assert _questions(stand_in) == ["/server_info", TOKEN_GENERATE_PATH]  # once each
        client = from_dict(handle.to_dict()).client()  # as the training process builds it from the job's handle
        assert client.has_transfer_engine() and client.serves_token_generate()
        assert len(_questions(stand_in)) == 2  # not asked again
    finally:
        stand_in.shutdown()


def test_a_replica_set_records_for_every_replica_and_a_server_without_the_engine_says_so():
    replicas = [JSONServer(lambda path: {"vllm_config": {}} if path == "/server_info" else {"choices": []})
                for _ in range(2)]
    try:
        members = tuple(ExternalServer(r.url).to_dict() for r in replicas)
        handle = record_capabilities(ReplicaSet(replicas[0].url, replicas=members))
        assert handle.capabilities == ServerCapabilities(transfer_engine=False, token_route=True)
        assert not handle.capabilities.in_flight
        assert [len(_questions(r)) for r in replicas] == [2, 2]
        # the handle is a JSON record too (a replaced server's, shared by a gang's nodes: lifecycle.ensure_server)
        record = json.loads(json.dumps(handle.to_dict(), default=dataclasses.asdict))
        assert from_dict(record).capabilities == handle.capabilities
        client = from_dict(handle.to_dict()).client()
        assert not client.has_transfer_engine() and client.serves_token_generate()
        assert [len(_questions(r)) for r in replicas] == [2, 2]
    finally:
        for r in replicas:
            r.shutdown()
