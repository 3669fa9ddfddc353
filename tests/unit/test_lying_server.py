"""The vLLM client against a server that lies: a tiny HTTP server of the test's own on 127.0.0.1 answers what each
case says (a worker someone else put behind the router, and the other lies of an answer). Each lie must end in a
:class:`GenerationServerError` that says what is wrong, never in rollouts."""

import socket
import threading
import time

import pytest

from grpo_steps.servers.base import ServerStartError
from grpo_steps.servers.client import GenerationServerError, VLLMClient
from tests.json_server import JSONServer


class Liar(JSONServer):
    """Answers ``answers[path]`` (a dict as JSON) to any request of ``path``; records each request's headers."""

    def __init__(self, answers: dict[str, dict]) -> None:
        self.answers = answers
        super().__init__(lambda path: self.answers.get(path, {}))

    @property
    def headers_seen(self) -> list[dict]:
        return [headers for _, _, headers in self.seen]


def _models(*names: str) -> dict:
    return {"data": [{"id": name, "root": "/w", "parent": None} for name in names]}


def _completion(model: str = "policy@r0", ids=(5, 6), logprobs=(-0.5, -0.25), index: int = 0) -> dict:
    return {"model": model, "choices": [{"index": index, "text": "ab", "finish_reason": "length",
                                         "token_ids": list(ids), "logprobs": {"token_logprobs": list(logprobs)}}]}


@pytest.fixture
def replicas():
    servers = [Liar({"/v1/models": _models(f"policy@r{i}", "policy")}) for i in range(2)]
    yield servers
    for server in servers:
        server.shutdown()


def test_a_routed_answer_under_a_name_no_replica_serves_is_refused(replicas):
    router = Liar({"/v1/completions": _completion(model="evil-worker")})
    client = VLLMClient(router.url, replicas=tuple(r.url for r in replicas))
    with pytest.raises(GenerationServerError, match="answered as model 'evil-worker', which none of the run's"):
        client.complete([[1, 2]], 1, max_tokens=2, temperature=1.0)
    router.answers["/v1/completions"] = _completion(model="policy@r1")
    (([sample],),) = [client.complete([[1, 2]], 1, max_tokens=2, temperature=1.0)]
    assert sample["completion_ids"] == [5, 6] and sample["replica"] == 1
    router.shutdown()


LIES = [
    (_completion(ids=(5, 500)), "a token id outside the vocabulary"),  # out of the 100-token vocabulary
    (_completion(ids=(5, -1)), "a token id outside the vocabulary"),
    (_completion(logprobs=(-0.5, float("nan"))), "not a finite number"),  # NaN
    (_completion(logprobs=(-0.5, float("-inf"))), "not a finite number"),
    (_completion(logprobs=(-0.5,)), "unequal length"),  # 2 ids, 1 logprob
    ({"model": "policy", "choices": []}, "answered 0 choices for 1 prompt"),
    (_completion(index=3), "indices"),  # an index past n
]


@pytest.mark.parametrize(("answer", "message"), LIES)
def test_an_answer_that_lies_is_refused(answer, message):
    server = Liar({"/v1/completions": answer})
    client = VLLMClient(server.url, vocab_size=100)
    with pytest.raises(GenerationServerError, match=message):
        client.complete([[1, 2]], 1, max_tokens=2, temperature=1.0)
    server.answers["/v1/completions"] = _completion(model="policy")  # the truth passes
    assert client.complete([[1, 2]], 1, max_tokens=2, temperature=1.0)[0][0]["completion_ids"] == [5, 6]
    server.shutdown()


class Trickler:
    """A server on 127.0.0.1 that accepts, reads the request and then sends its answer one byte every 0.2 s (each
    read well inside any socket timeout), forever: from its first header line (``in_head``) or after the headers."""

    def __init__(self, in_head: bool) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.in_head, self.stop = in_head, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            conn, _ = self.sock.accept()
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn) -> None:
        conn.recv(65536)
        if not self.in_head:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
        try:
            while not self.stop.is_set():
                conn.sendall(b"X" if self.in_head else b" ")
                time.sleep(0.2)
        except OSError:
            pass  # the client cut the connection: what the test wants
        conn.close()


@pytest.mark.parametrize("in_head", [False, True], ids=["body", "head"])
def test_a_server_that_trickles_bytes_is_cut_at_the_total_deadline(in_head):
    server = Trickler(in_head)
    client = VLLMClient(server.url, timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(GenerationServerError, match="no complete answer"):
        client.complete([[1, 2]], 1, max_tokens=2, temperature=1.0)
    assert time.monotonic() - started < 10.0  # 2 s, with room for a loaded machine
    server.stop.set()


def test_the_token_never_goes_in_plain_http_to_another_host(monkeypatch):
    monkeypatch.setenv("GRPO_SERVER_TOKEN", "tok")
    with pytest.raises(GenerationServerError, match="plain HTTP"):
        VLLMClient("http://10.255.1.2:8000")  # refused before any request
    VLLMClient("https://gpu.example.com:8000")  # TLS
    VLLMClient("http://127.0.0.1:8000")  # loopback
    VLLMClient("http://vllm-x.ns.svc:8000")  # a Kubernetes Service inside the cluster (see docs/security.md)
    monkeypatch.delenv("GRPO_SERVER_TOKEN")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    VLLMClient("http://10.255.1.2:8000")  # no token: nothing to leak


def test_an_external_server_that_answers_without_a_token_is_refused_unless_allowed(capsys):
    from grpo_steps.config import validate_config
    from grpo_steps.servers.external import ExternalServer

    server = Liar({"/health": {}, "/v1/models": _models("policy"),
                   "/server_info": {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}})
    cfg = validate_config({"generation": {"provider": "external", "server": {"endpoint": server.url}}})
    with pytest.raises(ServerStartError, match="answers without a token.*allow_unauthenticated: true"):
        ExternalServer.start(cfg)
    cfg = validate_config({"generation": {"provider": "external",
                                          "server": {"endpoint": server.url, "allow_unauthenticated": True}}})
    assert ExternalServer.start(cfg).served_model == "policy"
    assert "answers without a token" in capsys.readouterr().err
    server.shutdown()


def test_a_replica_that_lost_the_evaluated_weights_is_refused_before_its_answers_count(replicas):
    """Evaluation labels the weights it reloads and checks the label on every replica: one restarted since (its
    start-up weights, labelled ``default``) fails the check, naming each replica's label."""
    for replica, label in zip(replicas, ("eval-trained", "default"), strict=True):
        replica.answers["/weight_info"] = {"weight_version": label}
    router = Liar({})
    client = VLLMClient(router.url, replicas=tuple(r.url for r in replicas))
    with pytest.raises(GenerationServerError, match="disagree on the weight version"):
        client.check_weight_version("eval-trained")
    replicas[1].answers["/weight_info"] = {"weight_version": "eval-trained"}
    client.check_weight_version("eval-trained")
    single = VLLMClient(replicas[0].url)
    replicas[0].answers["/weight_info"] = {"weight_version": "default"}
    with pytest.raises(GenerationServerError, match="labelled 'default', not 'eval-trained'"):
        single.check_weight_version("eval-trained")
    router.shutdown()
