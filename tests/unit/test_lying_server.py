"""The vLLM client against a server that lies: a tiny HTTP server of the test's own on 127.0.0.1 answers what each
case says (a worker someone else put behind the router, and the other lies of an answer). Each lie must end in a
:class:`GenerationServerError` that says what is wrong, never in rollouts."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_steps.servers.client import GenerationServerError, VLLMClient


class Liar(ThreadingHTTPServer):
    """Answers ``answers[path]`` (a dict as JSON) to any request of ``path``; records each request's headers."""

    daemon_threads = True

    def __init__(self, answers: dict[str, dict]) -> None:
        self.answers, self.headers_seen = answers, []
        liar = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                liar.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
                body = json.dumps(liar.answers.get(self.path.split("?")[0], {})).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


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
