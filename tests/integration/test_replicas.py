"""Two generation replicas of the tiny model behind vLLM's router (``generation.server.replicas: 2``, the ``local``
provider, one core each), as the flow's ``provision_vllm`` starts them: requests spread over both, an episode stays on
one replica, training (asynchronous rollouts, and multi-turn tool rollouts) pushes every version to both and verifies
each, evaluation spreads its prompts, the LoRA flow on the HumanEval task config with a local distillation teacher
(killed and resumed) runs on both, and a replica killed mid-run fails the next push naming it, with nothing left
running once the set is stopped.
``weight_sync: s3`` on both: pushes with asynchronous rollouts, the receivers (late join, a corrupted delta, a store
that does not answer), and the trainer's faults (kill -9 mid-publish, S3 crashing mid-publish, then the resumed
attempts), on a real SeaweedFS. The
whole flow on two replicas started by the flow, with a replica killed mid-training and ``@retry`` replacing the set,
is the local run of tests/integration/test_resume.py."""

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from grpo_steps import servers
from grpo_steps.config import REPO_ROOT, load_config, validate_config
from grpo_steps.processes import PortInUseError, ProcessRef, wait_until
from grpo_steps.servers import local
from grpo_steps.servers.client import GenerationServerError, VLLMClient, session_id
from grpo_steps.servers.router import requests_per_replica
from grpo_steps.training.entry import run
from grpo_steps.weights.update import WeightUpdate
from tests.conftest import dev_s3_credentials
from tests.integration.flowrun import (
    SAVED,
    check_task_run,
    checkpoint_files,
    client_in_child,
    flow_client,
    flow_config,
    flow_env,
    flow_run_id,
    metric_steps,
    mlflow_runs,
    model_versions,
    on_replicas,
    run_config,
    run_flow,
    token_logprobs,
    vllm_child,
)
from tests.integration.trainjob import history as _history
from tests.integration.trainjob import job as _job

pytestmark = pytest.mark.slow
PEFT = {"r": 8, "alpha": 16}
MODEL_NAME = "grpo-lora-test"
TEACHER_SERVING = re.compile(r"\[teacher\] serving (\S+) supervisor_pid=(\d+)")
VERIFIED = re.compile(r"\[weight-sync\] version (\d+) verified on 2 replicas: (\S+) (\S+), (\S+) (\S+)")


@pytest.fixture(scope="module")
def replica_set(tiny_model_path):
    """Two replicas + a ``consistent_hash`` router, started by ``servers.provision`` (the flow's path)."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["model"]["max_model_len"] = 1024  # the tool run's prompts (configs/test-tools.yaml)
    config["generation"]["server"].update(replicas=2, router={"policy": "consistent_hash"})
    config["train"]["peft"] = {"r": 8, "alpha": 16}  # the replicas load LoRA adapters at run time (and full weights)
    cfg = validate_config(config)
    with pytest.MonkeyPatch.context() as env:  # what the flow's environment gives them: S3 credentials for s3 pushes
        for name, value in dev_s3_credentials().items():
            env.setenv(name, value)
        # the config pushes adapters (disk), whose servers get no S3 keys; these replicas serve the s3 tests too
        start_local = local.start_local
        env.setattr(local, "start_local", lambda *args, **kw: start_local(*args, **{**kw, "s3": True}))
        replica_set = servers.provision(cfg, tiny_model_path, owner=ProcessRef.of(os.getpid()),
                                        run_id="replicas-test")
    yield replica_set
    replica_set.stop()


class _Unchecked(WeightUpdate):
    """A request whose sender skipped the type's own checks (anyone holding the token can send one): the server's
    parse of the same type must refuse it."""

    def __post_init__(self) -> None:
        pass


def _with_replicas(job, replica_set):
    return job.model_copy(update={"server": replica_set.to_dict()})  # the handle whole: router and replicas


def _counts(replica_set) -> list[float]:
    counts = requests_per_replica(replica_set.metrics_endpoint)
    return [counts.get(member.endpoint, 0.0) for member in replica_set.members]


def test_two_replicas_behind_the_router_each_on_its_own_core(replica_set):
    assert isinstance(replica_set, servers.ReplicaSet) and len(replica_set.replicas) == 2
    assert replica_set.policy == "consistent_hash"
    cores = []
    for member in replica_set.members:
        (server,) = psutil.Process(member.supervisor_pid).children()
        # the model runs in vLLM's engine-core process (no worker process of its own), every process and thread of
        # the server confined to its core, a thread per core for its OpenMP pool
        names = [p.name() for p in server.children(recursive=True)]
        assert "VLLM::EngineCore" in names and not any("Worker" in name for name in names), names
        assert server.environ()["OMP_NUM_THREADS"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in server.environ()
        (core,) = os.sched_getaffinity(server.pid)
        for process in (server, *server.children(recursive=True)):
            assert all(os.sched_getaffinity(thread.id) == {core} for thread in process.threads()), process
        cores.append(core)
    assert sorted(cores) == [0, 1]
    handle = servers.from_dict(replica_set.to_dict())
    assert handle == replica_set and handle.serves(ProcessRef.of(os.getpid()))
    # the router passes the run's token on; without it a replica refuses the request
    assert requests.post(f"{replica_set.endpoint}/v1/completions", json={"model": "policy", "prompt": [[5, 6]],
                                                                        "max_tokens": 2}, timeout=30).status_code == 401


def test_requests_spread_over_both_and_an_episode_stays_on_one(replica_set):
    client = replica_set.client()
    before = _counts(replica_set)
    groups = client.complete([[100 + i, 7, 8] for i in range(16)], 2, max_tokens=4, temperature=1.0)
    spread = [after - b for after, b in zip(_counts(replica_set), before, strict=True)]
    assert sum(spread) == 16 and min(spread) > 0, spread  # one request per group; the router spread them
    # each answer says which replica sampled it (its first served name, policy@r<i>), as the router counted them
    assert all(len({sample["replica"] for sample in group}) == 1 for group in groups)
    assert [sum(group[0]["replica"] == i for group in groups) for i in (0, 1)] == spread
    before = _counts(replica_set)
    episode = [[300, 9, 9], [300, 9, 9, 41, 42], [300, 9, 9, 41, 42, 43, 44]]  # the turns of one episode
    turns_out = client.complete(episode, 1, max_tokens=2, temperature=1.0, sessions=[session_id(episode[0])] * 3)
    turns = [after - b for after, b in zip(_counts(replica_set), before, strict=True)]
    assert sorted(turns) == [0, 3], turns
    assert {turn[0]["replica"] for turn in turns_out} == {turns.index(3)}


def test_lora_adapter_pushes_reach_both_replicas(tmp_path, tiny_model_path, tiny_tokenizer, replica_set, capfd):
    """Before any full-weights push: an adapter applies to the base weights the replicas started with."""
    from grpo_steps.weights.labels import adapter_name

    run(_with_replicas(_job(tmp_path, tiny_model_path, tiny_tokenizer, replica_set.endpoint,
                            train={"max_steps": 2, "peft": {"r": 8, "alpha": 16}}), replica_set))
    verified = VERIFIED.findall(capfd.readouterr().out)
    assert [(v[0], v[2], v[4]) for v in verified] == [("0", "step-0", "step-0"), ("1", "step-1", "step-1")]
    # the run's close unloads its last adapter from every replica
    served = [VLLMClient(m.endpoint).served_adapters() for m in replica_set.members]
    assert served == [{}, {}], served
    assert adapter_name("policy", 1) not in replica_set.client().served_adapters()
    # an adapter's answers carry the adapter's name, not the replica's: which replica sampled is not known
    assert not [k for h in _history(tmp_path) for k in h if re.match(r"(generation|weight_sync)/replica\d", k)]


def test_training_with_async_rollouts_pushes_every_version_to_both_replicas(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                           replica_set, capfd):
    before = _counts(replica_set)
    run(_with_replicas(_job(tmp_path, tiny_model_path, tiny_tokenizer, replica_set.endpoint,
                            generation={"async": True}), replica_set))
    out = capfd.readouterr().out
    verified = VERIFIED.findall(out)
    assert [int(v[0]) for v in verified] == [0, 1, 2], out[-3000:]  # one push per optimizer step, before it samples
    for version, first, first_label, second, second_label in verified:
        assert {first, second} == {m.endpoint for m in replica_set.members}
        assert first_label == second_label == f"step-{version}"  # two version labels per push
    assert [h["weight_sync/replicas"] for h in _history(tmp_path)] == [2.0, 2.0, 2.0]
    assert [h["async/staleness"] <= 1 for h in _history(tmp_path)] == [True] * 3
    # which replica sampled each generation round's completions, and the first-batch check per replica that sampled
    # (the round after the first push: later rounds were sampled ahead by the version before)
    for h in _history(tmp_path):
        counts = [h[f"generation/replica{i}/completions"] for i in (0, 1)]
        assert sum(counts) == 8, h
        if "weight_sync/first_batch_logp_diff" in h:
            assert [f"weight_sync/replica{i}/first_batch_logp_diff" in h for i in (0, 1)] == [c > 0 for c in counts]
            gaps = [h[k] for k in h if k.startswith("weight_sync/replica") and k.endswith("first_batch_logp_diff")]
            # the overall gap is the token-weighted mean of the replicas' (one process)
            assert min(gaps) - 1e-9 <= h["weight_sync/first_batch_logp_diff"] <= max(gaps) + 1e-9, h
    assert "weight_sync/first_batch_logp_diff" in _history(tmp_path)[0]
    # the mismatch per replica, weighed in the loss (the correction's loss-side path), for the replicas that sampled
    for h in _history(tmp_path):
        counts = [h[f"generation/replica{i}/completions"] for i in (0, 1)]
        assert [f"sampling/replica{i}/sampling_logp_difference/mean" in h for i in (0, 1)] == [c > 0 for c in counts]
    first = _history(tmp_path)[0]  # sampled by the version it trains (later steps: by the one before, async)
    assert max(v for k, v in first.items() if re.match(r"sampling/replica\d/", k)) < 1e-3, first
    assert [VLLMClient(m.endpoint).weight_version() for m in replica_set.members] == ["step-2", "step-2"]
    # the router served the producer's rollouts; which replicas is consistent_hash's choice per prompt: with the ~6
    # prompts of 3 steps all of them land on one replica in 1 run of 32 (it did once in CI), so the spread over both
    # is asserted where there are enough prompts (above, evaluation, and test_resume.py's local flow)
    assert sum(after - b for after, b in zip(_counts(replica_set), before, strict=True)) > 0


def _store(s3, name: str) -> dict:
    return {"bucket": s3.bucket, "prefix": f"weight-sync/{name}", "endpoint_url": s3.endpoint}


def _s3_keys(s3, prefix: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                          aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    return [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
            for o in page.get("Contents", [])]


@pytest.mark.s3
def test_s3_pushes_with_async_rollouts_reach_both_replicas_and_leave_nothing(tmp_path, tiny_model_path,
                                                                            tiny_tokenizer, replica_set, s3, capfd,
                                                                            monkeypatch):
    """``weight_sync: s3`` with asynchronous rollouts on two replicas: every version is published to the chain (an
    anchor, then deltas), loaded by both replicas through vLLM's weight-update protocol and verified there (label and
    probe); the push metrics reach the logs; the run's prefix is empty when training ends."""
    for name, value in dev_s3_credentials().items():  # the trainer's environment, as the flow's
        monkeypatch.setenv(name, value)
    store = _store(s3, "async-run")
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, replica_set.endpoint,
               generation={"async": True, "weight_sync": "s3", "s3_sync": {"anchor_every": 2}})
    run(_with_replicas(job, replica_set).model_copy(update={"weight_store": store}))
    out = capfd.readouterr().out
    verified = VERIFIED.findall(out)
    assert [int(v[0]) for v in verified] == [0, 1, 2], out[-3000:]
    assert all(v[2] == v[4] == f"step-{v[0]}" for v in verified)
    history = _history(tmp_path)
    assert [h["weight_sync/anchor"] for h in history] == [1.0, 0.0, 1.0]  # anchor_every 2: version 2 is an anchor
    assert [h["weight_sync/density"] for h in history][0] == 1.0
    assert 0 < history[1]["weight_sync/bytes"] < history[0]["weight_sync/bytes"]  # a delta is smaller
    for h in history:
        assert h["weight_sync/replicas"] == 2.0
        assert h["weight_sync/raw_bytes"] > 0 and h["weight_sync/load_seconds"] > 0
        assert h["weight_sync/fetch_seconds"] >= 0
        assert h["async/staleness"] <= 1
        # pushes in flight on both replicas (pause keep), each token's version from the router's answers
        assert h["async/dropped"] == 0 and "weight_sync/drain_seconds" not in h
        assert h["async/token_staleness_max"] <= 1 and 0 <= h["async/spanning_share"] <= 1
    assert history[0]["weight_sync/first_batch_logp_diff"] < 1e-3  # the replicas sample from the trainer's weights
    assert [VLLMClient(m.endpoint).weight_version() for m in replica_set.members] == ["step-2", "step-2"]
    assert _s3_keys(s3, store["prefix"]) == []
    # the last version both replicas loaded, for the registered model's tags (anchor_every 2: version 2 is an anchor)
    lineage = json.loads((tmp_path / "out" / "weight_lineage.json").read_text())
    assert {k: lineage[k] for k in ("version", "anchor", "deltas")} == {"version": "2", "anchor": "2", "deltas": "0"}
    assert re.fullmatch(r"[0-9a-f]{64}", lineage["sha256"])


@pytest.mark.s3
def test_s3_chain_on_two_replicas_late_join_corruption_and_outage(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                   replica_set, s3, monkeypatch):
    """The chain's receivers on two real replicas: each version's weights serve as the trainer's (probe against the
    policy's own logprobs); a replica that missed every version replays the chain from the anchor; a corrupted
    delta is refused by name, forged manifests (no digest, a swapped one, a self-referencing base, a missing tensor,
    a version in another dtype)
    are refused by what they break, and a store that does not answer fails by key, each leaving the replica on the
    weights and label it served."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.training.generation.s3 import ChainTransport
    from grpo_steps.training.sampling import policy_logprobs
    from grpo_steps.weights.chain import tensor_checksum
    from grpo_steps.weights.files import checkpoint_state_dict
    from grpo_steps.weights.labels import version_label

    for name, value in dev_s3_credentials().items():
        monkeypatch.setenv(name, value)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    first, second = (VLLMClient(m.endpoint) for m in replica_set.members)
    client = VLLMClient(first.endpoint, replicas=(first.endpoint, second.endpoint))
    push = ChainTransport(client, _store(s3, "receivers"), dtype=torch.float32, anchor_every=10)

    def step() -> dict:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        return model.state_dict()

    def serves_policy(replica: VLLMClient) -> bool:
        return max(abs(a - b) for a, b in zip(replica.prompt_logprobs(ids), policy_logprobs(model, ids),
                                              strict=True)) < 1e-4

    try:
        only_first = VLLMClient(first.endpoint)  # the second replica misses versions 0-2
        push.client = only_first
        for version in range(3):
            push.push(step(), version, model=model)
            push.committed(version)
            assert serves_policy(first)
        push.client = client
        parts = push.push(step(), 3, model=model)
        push.committed(3)
        assert [r.weight_version() for r in (first, second)] == [version_label(3)] * 2
        assert serves_policy(first) and serves_policy(second)
        caught_up, late = (replica.update_report for replica in client.replica_clients())  # as each loaded it
        assert late["version"] == caught_up["version"] == 3
        assert late["bytes_read"] > caught_up["bytes_read"] > 0  # the anchor and three deltas vs one delta
        assert parts["anchor"] == 0.0 and 0 < parts["density"] <= 1
        # the chain's checksums are the trainer's tensors': what the replicas loaded is what was published
        manifest = push.chain.reader.manifest(3, push.last.sha256)

        published = checkpoint_state_dict(model.state_dict(), model)
        assert manifest["checksum"] == "blake3"
        assert {n: e["checksum"] for n, e in manifest["tensors"].items()} == {
            n: tensor_checksum(t.contiguous()) for n, t in published.items()}

        # a corrupted delta: every byte of its data objects flipped; refused by the checksum, nothing loaded
        import boto3

        raw = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                           aws_secret_access_key=s3.secret_key, region_name="us-east-1")
        served_before = first.prompt_logprobs(ids)
        stats = push.chain.publish(checkpoint_state_dict(step(), model), 4)
        assert not stats.anchor
        for key in push.chain.reader.manifest(4)["objects"]:
            body = raw.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
            raw.put_object(Bucket=s3.bucket, Key=key, Body=bytes(b ^ 0xFF for b in body))
        update = WeightUpdate.of_chain(push.store, 4, stats.sha256)
        with pytest.raises(GenerationServerError, match=r"tensor .* refused twice"):
            first.update_weights(update, version_label(4))
        assert first.weight_version() == version_label(3)
        assert first.prompt_logprobs(ids) == pytest.approx(served_before, abs=1e-6)

        # forgeries by a writer of the bucket, each refused by the replica's engine before anything is loaded:
        manifest_key = f"{push.store['prefix']}/manifests/{4:010d}.json"
        manifest = json.loads(raw.get_object(Bucket=s3.bucket, Key=manifest_key)["Body"].read())
        forged = json.dumps({**manifest, "base": {**manifest["base"], "version": 4}}).encode()  # a self-reference
        raw.put_object(Bucket=s3.bucket, Key=manifest_key, Body=forged)
        refusals = {  # the update request -> what the refusal says
            "no digest": (_Unchecked(s3=push.store, version=4), "has no sha256"),
            "the trainer's digest": (update, "is not the one the trainer published"),
            "the forgery's own digest": (dataclasses.replace(update, sha256=hashlib.sha256(forged).hexdigest()),
                                         "a delta's base must be .*older than this one"),
        }
        # a version missing one tensor (its digest genuine): refused against the served model's checkpoint
        partial = ChainTransport(client, _store(s3, "receivers-partial"), dtype=torch.float32)
        state = checkpoint_state_dict(model.state_dict(), model)
        missing = sorted(state)[0]
        stats = partial.chain.publish({k: v for k, v in state.items() if k != missing}, 0)
        refusals["a missing tensor"] = (WeightUpdate.of_chain(partial.store, 0, stats.sha256),
                                        rf"missing \['{re.escape(missing)}'\]")
        # a version in another dtype than the served one (its digest genuine): refused, where the load would cast
        half = ChainTransport(client, _store(s3, "receivers-half"), dtype=torch.float16)
        stats = half.chain.publish(state, 0)
        refusals["another dtype"] = (WeightUpdate.of_chain(half.store, 0, stats.sha256),
                                     r"tensor .* is float16 .*, the served model has float32")
        for case, (request, error) in refusals.items():
            with pytest.raises(GenerationServerError, match=error):
                first.update_weights(request, version_label(4))
            assert first.weight_version() == version_label(3), case
            assert first.prompt_logprobs(ids) == pytest.approx(served_before, abs=1e-6), case
        partial.close()
        half.close()

        # a store that does not answer: the update fails naming the key, the replica keeps serving version 3
        dead = dict(push.store, endpoint_url="http://127.0.0.1:9")  # the discard port: nothing listens
        with pytest.raises(GenerationServerError, match=r"s3://.*manifests/0000000004\.json"):
            second.update_weights(WeightUpdate.of_chain(dead, 4, stats.sha256), version_label(4))
        assert second.weight_version() == version_label(3)
    finally:
        push.close()
        client.reload_weights(tiny_model_path, label="default")
    assert _s3_keys(s3, push.store["prefix"]) == []


def _s3_waiting_for(process: int, port: int) -> bool:
    """Whether a request of ``process`` sits unread at the S3 server listening on 127.0.0.1:``port`` (its bytes in the
    server side's receive queue, /proc/net/tcp): the frozen server holds the process in that request."""
    ports = {c.laddr.port for c in psutil.Process(process).net_connections(kind="tcp") if c.raddr
             and c.raddr.port == port}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if (int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) in ports
                and int(queues.split(":")[1], 16) > 0):
            return True
    return False


class EntryRun:
    """The training entry (``python -m grpo_steps.training JOB``) as a process of its own, its output read line by
    line; ``at(line, proc)`` acts on each line (fault injection by the PIDs the test started)."""

    def __init__(self, tmp_path, job, name: str) -> None:
        self.job_file = tmp_path / f"{name}.json"
        self.job_file.write_text(job.model_dump_json())

    def __call__(self, at=None) -> tuple[int, str]:
        import subprocess
        import sys

        env = {**flow_env(), **dev_s3_credentials()}
        proc = subprocess.Popen([sys.executable, "-m", "grpo_steps.training", str(self.job_file)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if at:
                    at(line, proc)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return proc.returncode, "".join(lines)


def _freeze_on(s3, marker: str, then, events: dict):
    """At ``marker``'s line: freeze the S3 server (SIGSTOP to its process group), wait until the training process's
    next S3 request sits unread at it, then ``then(proc)``."""
    import time

    port = int(s3.endpoint.rsplit(":", 1)[1])

    def at(line: str, proc) -> None:
        if marker in line and "frozen" not in events:
            os.killpg(s3.process.pid, signal.SIGSTOP)
            events["frozen"] = time.monotonic()
            assert wait_until(lambda: _s3_waiting_for(proc.pid, port), timeout_s=120, interval_s=0.05)
            then(proc)

    return at


@pytest.mark.s3
def test_s3_kill_mid_publish_and_an_outage_mid_push_then_resume(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                 replica_set, local_s3, monkeypatch, capfd):
    """``weight_sync: s3`` faults of the trainer's side, each in the training entry as its own process on the two
    replicas and a real SeaweedFS: (1) kill -9 of the training process while it publishes version 1 (held there by a
    frozen S3): no version 1 becomes visible, the replicas keep serving version 0; (2) resumed from checkpoint 1: what
    the killed attempt left is removed, the chain starts again with an anchor, and S3 dies while version 2 is being
    published: the step fails naming the key after botocore's bounded retries, the replicas keep serving version 1;
    (3) resumed from checkpoint 2 on S3 started again (same port, same data; in this process): the leftovers removed
    again, version 2 an anchor, 3 a delta, both verified on both replicas, which serve checkpoint 3's policy
    (logprobs), the lineage's checksums are checkpoint 3's tensors', and nothing is left under the run's prefix."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.dev import local_s3 as s3_server
    from grpo_steps.training.generation.s3 import lineage_of
    from grpo_steps.training.sampling import policy_logprobs
    from grpo_steps.weights.chain import chain_of, tensor_checksum
    from grpo_steps.weights.files import checkpoint_state_dict

    for name, value in dev_s3_credentials().items():  # this process reads the chain too
        monkeypatch.setenv(name, value)
    s3 = local_s3
    store = _store(s3, "faults")
    prefix = f"{store['prefix']}/"
    job = _with_replicas(_job(tmp_path, tiny_model_path, tiny_tokenizer, replica_set.endpoint,
                              train={"max_steps": 4, "save_steps": 1, "save_total_limit": 4},
                              generation={"weight_sync": "s3"}), replica_set).model_copy(update={"weight_store": store})
    checkpoint = str(tmp_path / "out" / "checkpoint-{}")
    labels = lambda: [VLLMClient(m.endpoint).weight_version() for m in replica_set.members]  # noqa: E731

    # (1) kill -9 mid-publish: S3 frozen after step 1, the trainer held in version 1's publish, killed there
    events, killed = {}, []

    def kill(proc) -> None:
        proc.kill()  # SIGKILL of the training process (our child), mid-publish
        killed.append(proc.pid)
        os.killpg(s3.process.pid, signal.SIGCONT)

    code, first = EntryRun(tmp_path, job, "first")(_freeze_on(s3, "[train] step 1/4", kill, events))
    assert killed and code == -signal.SIGKILL, first[-5000:]
    assert [int(v[0]) for v in VERIFIED.findall(first)] == [0]
    assert (Path(checkpoint.format(1)) / "model.safetensors").is_file()
    left = _s3_keys(s3, prefix)
    assert f"{prefix}manifests/0000000000.json" in left
    assert chain_of(store).versions() == [0]  # version 1 never became visible: no manifest
    assert labels() == ["step-0", "step-0"]

    # (2) resumed from checkpoint 1; S3 dies (SIGKILL) while the trainer waits on it in version 2's publish
    events = {}

    def outage(proc) -> None:
        os.killpg(s3.process.pid, signal.SIGKILL)  # the S3 server crashes: the request in flight is reset

    resumed = job.model_copy(update={"resume_from": checkpoint.format(1)})
    code, second = EntryRun(tmp_path, resumed, "second")(_freeze_on(s3, "[train] step 2/4", outage, events))
    assert code not in (0, -signal.SIGKILL), second[-5000:]
    removed = re.search(rf"removed (\d+) objects under s3://{s3.bucket}/{prefix} left by an earlier attempt", second)
    assert removed and int(removed.group(1)) >= len(left), second[-5000:]  # (+ the frozen put, once S3 went on)
    assert [int(v[0]) for v in VERIFIED.findall(second)] == [1]
    assert re.search(rf"ChainStoreError: S3 \w+ of s3://{s3.bucket}/{prefix}\S*0000000002\S* failed after "
                     "botocore's retries", second), second[-5000:]
    assert labels() == ["step-1", "step-1"]  # nothing half-loaded

    # (3) S3 back on the same port and data; resumed from checkpoint 2, to the end
    port = int(s3.endpoint.rsplit(":", 1)[1])
    restarted = []

    def restart() -> bool:
        try:  # the port can stay busy for a moment after the crash
            restarted.append(s3_server.start(Path(s3.log_path).parent, port=port))
        except (s3_server.S3StartError, PortInUseError):
            return False
        return True

    assert wait_until(restart, timeout_s=60, interval_s=1.0), "S3 did not start again"
    (restarted,) = restarted
    try:
        left = _s3_keys(restarted, prefix)
        assert f"{prefix}manifests/0000000001.json" in left  # the anchor the second attempt verified
        resumed = job.model_copy(update={"resume_from": checkpoint.format(2)})
        capfd.readouterr()
        run(resumed)  # in this process: nothing to kill here, and one interpreter start less
        out = capfd.readouterr()
        third = out.out + out.err
        assert f"removed {len(left)} objects under s3://{s3.bucket}/{prefix} left by an earlier attempt" in third
        verified = VERIFIED.findall(third)
        assert [int(v[0]) for v in verified] == [2, 3] and all(v[2] == v[4] == f"step-{v[0]}" for v in verified)
        anchors = {h["step"]: h["weight_sync/anchor"] for h in _history(tmp_path) if h["step"] > 2}
        assert anchors == {3: 1.0, 4: 0.0}  # the resumed chain starts with an anchor
        assert _s3_keys(restarted, prefix) == []
    finally:
        s3_server.stop(restarted)
    # what both replicas serve is checkpoint 3's policy (version 3), and so are the chain's checksums
    policy = AutoModelForCausalLM.from_pretrained(checkpoint.format(3), dtype=torch.float32)
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    for member in replica_set.members:
        served = VLLMClient(member.endpoint).prompt_logprobs(ids)
        assert max(abs(a - b) for a, b in zip(served, policy_logprobs(policy, ids), strict=True)) < 1e-4
    published = checkpoint_state_dict(policy.state_dict(), policy)
    manifest = {"version": 3, "anchor": 2, "depth": 1, "checksum": "blake3",
                "tensors": {n: {"checksum": tensor_checksum(t.contiguous())} for n, t in published.items()}}
    assert json.loads((tmp_path / "out" / "weight_lineage.json").read_text()) == lineage_of(manifest)


def test_multi_turn_tool_rollouts_on_two_replicas(tmp_path, tiny_model_path, tiny_tokenizer, replica_set, capfd):
    tools = yaml.safe_load((REPO_ROOT / "configs" / "test-tools.yaml").read_text())
    # a generation batch of 2 micro-batches, one trained per optimizer step: TRL's own scoring pass weighs the
    # correction (not the loss), so the mismatch per replica comes from that path here
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, replica_set.endpoint, train={**tools["train"],
               "max_steps": 1, "grpo": {"steps_per_generation": 2}}, generation=tools["generation"] | {"server": {}},
               model=tools["model"], data=tools["data"], tools=tools["tools"])
    run(_with_replicas(job, replica_set))
    (h,) = _history(tmp_path)
    assert h["tools/call_frequency"] == 1.0 and h["tools/turns_per_episode"] == 2.0
    assert len(VERIFIED.findall(capfd.readouterr().out)) == 1
    # which replica sampled each episode's first turn, and TRL's mismatch per replica that sampled; (the structured
    # output's regex forces tokens the unconstrained policy finds unlikely: the mismatch is large, ~10 nats)
    counts = [h[f"generation/replica{i}/completions"] for i in (0, 1)]
    assert sum(counts) == 8, h
    assert [f"sampling/replica{i}/sampling_logp_difference/mean" in h for i in (0, 1)] == [c > 0 for c in counts], h


def test_a_first_batch_above_the_limit_names_the_replicas_that_sampled_it(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                          replica_set):
    job = _job(tmp_path, tiny_model_path, tiny_tokenizer, replica_set.endpoint, train={"max_steps": 1},
               generation={"sync_check": {"max_logp_diff": 1e-12}})  # below float32 kernel noise: every replica
    with pytest.raises(GenerationServerError, match=r"step 1: the first batch sampled after pushing version 0") as err:
        run(_with_replicas(job, replica_set))
    named = re.findall(r"replica (\d)/2 (\S+): ", str(err.value))
    assert named and all(replica_set.members[int(i) - 1].endpoint == endpoint for i, endpoint in named), str(err.value)


def test_evaluation_spreads_its_prompts(replica_set, tiny_tokenizer):
    from grpo_steps.data import prepare
    from grpo_steps.evaluation.policy import evaluate_policy

    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    # 32 prompts, not the 8 of the test config: consistent_hash puts 8 sessions on one of two replicas in 1 run of
    # 128 (it did once, in CI on 2026-11-26)
    config["data"]["num_eval"] = 32
    cfg = validate_config(config)
    rows = prepare(cfg.data, tiny_tokenizer, cfg.generation.chat_template_kwargs).eval
    before = _counts(replica_set)
    result = evaluate_policy(cfg, replica_set.client(), tiny_tokenizer, rows)
    spread = [after - b for after, b in zip(_counts(replica_set), before, strict=True)]
    assert len(result["prompt_keys"]) == len(rows) == 32
    assert sum(spread) == 2 * len(rows)  # one request per prompt for the samples, one for its greedy completion
    # (when this fails, the router's log says whether it took a replica out of rotation for failed health checks)
    assert min(spread) > 0, (spread, Path(replica_set.router_server.log_path).read_text()[-3000:])


def test_lora_flow_killed_and_resumed_pushes_the_adapter_every_step_and_registers_the_merged_model(
        tmp_path, replica_set, tiny_model_path):
    """LoRA (``train.peft``) end to end on the two LoRA-enabled replicas (provider ``external``), on the HumanEval task
    config (configs/test-humaneval.yaml: code run in the sandbox as the reward): one flow run killed (kill -9 of the
    training process after checkpoint ``kill_after``) and resumed, then the whole flow checked on it: the adapter
    pushed to both replicas every step and verified, rollouts and evaluation on base + adapter, checkpoints of adapter
    + optimizer, the merged model registered, and the task's own checks (:func:`check_task_run`). With a distillation
    teacher (``teacher:``, provider ``local``, started by the flow): its term logged every step across the kill, the
    killed run's teacher replaced on ``resume``, named in the MLflow run, none left running. One flow for the four
    (each whole flow costs minutes in ``make test``). Before the last test: that one kills a replica."""
    import mlflow
    import torch
    from mlflow import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    max_steps, save_steps, kill_after = 4, 2, 2  # a checkpoint before the kill and one after the resume
    config = on_replicas(flow_config("test-humaneval.yaml", registry={"model_name": MODEL_NAME},
                                     train={"max_steps": max_steps, "save_steps": save_steps, "retries": 0,
                                            "peft": PEFT}, eval={"correctness_reward": "code_execution"}),
                         replica_set)
    # the tiny random policy passes no unit test: code_execution alone gives every group equal rewards, no gradient,
    # and an adapter that stays zero; a length reward (DAPO's soft overlong punishment over most of the 24-token
    # budget) varies within every group, so the adapter trains
    config["rewards"].append({"name": "soft_overlong_punishment", "options": {"max_completion_len": 24,
                                                                               "soft_punish_cache": 20}})
    # the teacher: the policy's starting weights on a vLLM server of its own that the flow starts and stops
    # (generation.temperature stays 1, as teacher_refusal needs); what it teaches is not checked here, its plumbing is
    config["teacher"] = {"model": tiny_model_path, "mode": "mixed", "kl_coef": 0.5, "provider": "local"}
    env, killed, teachers = flow_env(), [], []

    def watch_teachers(line: str) -> None:
        serving = TEACHER_SERVING.search(line)
        if serving:  # (endpoint, the teacher's supervisor): alive now, its create time recorded
            teachers.append((serving.group(1), ProcessRef.of(int(serving.group(2)))))

    def kill_after_checkpoint(line: str) -> None:
        watch_teachers(line)
        match = SAVED.search(line)
        if match and int(match.group(1)) == kill_after and not killed:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the training process, by the PID it reported
            killed.append(int(match.group(2)))

    code, out = run_config(tmp_path, env, config, kill_after_checkpoint)
    assert killed and code != 0, out[-5000:]
    assert len(teachers) == 1, out[-5000:]  # provision_vllm started it
    code, resumed = run_flow(tmp_path, env, ["resume"], watch_teachers)
    assert code == 0, resumed[-6000:]
    assert f"resuming from step {kill_after} of run {flow_run_id(out)}" in resumed
    # the killed run's teacher is owned by the killed runtime (lifecycle.ensure_teacher: a local server of another
    # owner stops itself within orphan_grace_s, so it is never kept): the resumed train step stops it and starts one,
    # which evaluate leaves alone (it scores nothing with a teacher: steps.ensure_server(teacher=False)) and end stops
    assert resumed.count(f"[teacher] local generation server {teachers[0][0]} belongs to an earlier run or is not "
                         "answering: starting a new one") == 1
    assert len(teachers) == 2 and teachers[1][0] != teachers[0][0], teachers
    # both stopped before the runtime exits (LocalServer.stop waits for the supervisor: SIGTERM, SIGKILL after 30 s);
    # the bound only absorbs the reaping of the stopped supervisor
    assert wait_until(lambda: not any(ref.is_running() for _, ref in teachers), timeout_s=10), \
        "a teacher server outlived the run that started it"
    (run,) = mlflow_runs(tmp_path)  # one MLflow run, one continuous history
    assert run.info.status == "FINISHED"
    run_id, resumed_id = run.info.run_id, flow_run_id(resumed)
    for metric in ("reward", "loss", "weight_sync/version", "distill/reverse_kl", "distill/teacher_share"):
        assert metric_steps(tmp_path, metric) == list(range(1, max_steps + 1)), metric
    assert {k: run.data.tags[k] for k in ("teacher.mode", "teacher.kl_coef", "teacher.model")} == {
        "teacher.mode": "mixed", "teacher.kl_coef": "0.5", "teacher.model": tiny_model_path}
    assert f"**Teacher** (on-policy distillation, mode mixed, lambda 0.5): `{tiny_model_path}`" in run.data.tags[
        "mlflow.note.content"]
    assert metric_steps(tmp_path, "train_runtime") == [max_steps]
    # every optimizer step sampled from a pushed, verified adapter (version 0 = the initial adapter, B = 0), the
    # resumed attempt's versions continuing at its checkpoint's
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    versions = [m.value for m in sorted(client.get_metric_history(run_id, "weight_sync/version"), key=lambda m: m.step)]
    assert versions == [float(v) for v in range(max_steps)]
    # ... and sampled from the policy: TRL's mismatch metric at float32 kernel noise
    assert max(m.value for m in client.get_metric_history(run_id, "sampling/sampling_logp_difference/mean")) < 1e-3
    for metric in ("distill/reverse_kl", "distill/teacher_share"):
        assert all(math.isfinite(m.value) for m in client.get_metric_history(run_id, metric)), metric
    # step 1 sampled from adapter version 0 (B = 0: the base weights), which the teacher serves: each sampled token's
    # teacher logprob is its sampler logprob, so the reverse KL is kernel noise (a misaligned position gives nats)
    first = min(client.get_metric_history(run_id, "distill/reverse_kl"), key=lambda m: m.step)
    assert first.step == 1 and abs(first.value) < 1e-3, first
    # each replica's engine metrics reached MLflow step by step (the router's counts: test_engine_metrics.py)
    assert all(client.get_metric_history(run_id, f"engine/replica{i}/requests_running") for i in (0, 1))

    # the checkpoints hold the adapter and its optimizer state, not the full weights
    files = checkpoint_files(tmp_path, env, resumed_id, node=0)
    assert "adapter_model.safetensors" in files and "optimizer.pt" in files, files
    assert "model.safetensors" not in files, files

    # evaluation: the baseline is the base weights, the trained policy base + adapter, both through the server:
    # the server's greedy logprobs of the first eval prompt differ
    baseline, trained = client_in_child(  # a child: the Metaflow client caches the first local datastore it found
        tmp_path, env, f"import json\nr = Flow('GRPOFlow')['{resumed_id}']['evaluate'].task.data.eval_report\n"
        "print(json.dumps([r['baseline']['probe_logprobs'], r['trained']['probe_logprobs']]))")
    assert baseline != trained
    assert "eval/trained/pass_at_1" in run.data.metrics
    with flow_client(tmp_path) as runs:  # the HumanEval task's checks on the same run
        check_task_run(load_config(tmp_path / "run.yaml"), client, runs[resumed_id])

    # registration: the merged model (a plain transformers model) with the adapter and its LoraConfig as artifacts
    (version,) = model_versions(tmp_path, MODEL_NAME)
    assert version.tags["base_model"] == "embedded:tiny-random-qwen2"
    adapter_dir = client.download_artifacts(run_id, "lora_adapter", str(tmp_path / "adapter"))
    assert json.loads((tmp_path / "adapter" / "lora_adapter" / "adapter_config.json").read_text())["r"] == PEFT["r"]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    merged_dir = mlflow.artifacts.download_artifacts(f"models:/{MODEL_NAME}/{version.version}",
                                                     dst_path=str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(merged_dir, "model"), dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                       adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = list(range(3, 40))
    expected, got = token_logprobs(policy, ids), token_logprobs(merged, ids)
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(token_logprobs(base, ids), got, strict=True)) > 1e-3  # it trained

    verified = re.findall(r"\[weight-sync\] version (\d+) verified on 2 replicas", out + resumed)
    assert sorted(set(int(v) for v in verified)) == list(range(max_steps))  # every push, on both replicas


def test_a_killed_replica_fails_the_push_by_name_and_nothing_outlives_the_set(replica_set):
    """Last in this module: it kills a replica of the shared set."""
    client = replica_set.client()
    dead = replica_set.members[1]
    os.killpg(vllm_child(dead.supervisor_pid), signal.SIGKILL)  # the vLLM server leads its own process group
    with pytest.raises(GenerationServerError) as raised:
        client.set_weight_version("step-99")  # what every push does after loading the weights
    message = str(raised.value)
    assert f"generation replica 2/2 {dead.endpoint} failed" in message and dead.log_path in message
    assert "generation replica 1/2" not in message
    assert not replica_set.serves(ProcessRef.of(os.getpid()))  # a retried step replaces the set
    supervisors = [ProcessRef(m.supervisor_pid, m.supervisor_started) for m in replica_set.members]
    router = replica_set.router_server
    replica_set.stop()
    assert not any(s.is_running() for s in supervisors) and not router.supervisor.is_running()
