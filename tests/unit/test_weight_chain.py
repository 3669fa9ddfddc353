"""The checked chain of weight versions (grpo_steps/weights/chain.py) on the project's real S3 server (SeaweedFS):
round trips, late joiners, corrupted and truncated objects, missing manifests, a publisher killed mid-version,
retention, the run's prefix removed, and an unreachable endpoint. One server for the module; a prefix per test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.s3


@pytest.fixture
def prefix(request):
    return f"runs/{request.node.name.replace('[', '-').rstrip(']')}"


def _chain(client, s3, prefix, **kw):
    from grpo_steps.weights.chain import WeightChain

    return WeightChain(client, s3.bucket, prefix, **kw)


def _writer(client, s3, prefix, **kw):
    from grpo_steps.weights.publisher import ChainPublisher

    return ChainPublisher(client, s3.bucket, prefix, **kw)


def _training_states(steps: int, seed: int = 0) -> list[dict]:
    """State dicts (fp32) after each of ``steps`` Adam steps of a small embedding + MLP model on random targets:
    consecutive optimizer steps, as the trainer's policy moves."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(128, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for _ in range(steps - 1):
        x = torch.randint(0, 64, (16,))  # half of the embedding rows get no gradient
        loss = (model(x) - torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def _same_bits(a: dict, b: dict) -> bool:
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(width[a[k].element_size()]),
                        b[k].reshape(-1).view(width[b[k].element_size()])) for k in a)


def _digest(client, s3, prefix, version: int) -> str:
    """The SHA-256 of version ``version``'s manifest as stored: what the trainer's update request names."""
    import hashlib

    key = f"{prefix}/manifests/{version:010d}.json"
    return hashlib.sha256(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()).hexdigest()


def _keys(client, s3, prefix) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix + "/").get("Contents", [])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chain_round_trips_bit_exactly(client, s3, prefix, dtype):
    import torch

    from grpo_steps.weights.chain import LocalCopy

    dtype = getattr(torch, dtype)
    states = _training_states(7)
    writer = _writer(client, s3, prefix, anchor_every=3, dtype=dtype)
    reader, kinds = LocalCopy(), []
    for version, state in enumerate(states, start=1):
        stats = writer.publish(state, version)
        writer.commit(version)
        kinds.append("anchor" if stats.anchor else "delta")
        got = _chain(client, s3, prefix).fetch(version, into=reader, sha256=stats.sha256)  # a replica following
        assert _same_bits(got, {k: v.to(dtype) for k, v in state.items()}), f"version {version} differs"
        assert reader.version == version
        if not stats.anchor:
            assert stats.bytes < stats.raw_bytes and 0 < stats.density < 1
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta", "anchor"]


def test_late_joiner_replays_from_the_newest_anchor(client, s3, prefix):
    import torch

    states = _training_states(5)
    writer = _writer(client, s3, prefix, anchor_every=3, dtype=torch.bfloat16)
    for version, state in enumerate(states, start=1):
        writer.publish(state, version)
        writer.commit(version)
    late = _chain(client, s3, prefix)
    assert late.latest_version() == 5
    assert [m["version"] for m in late.lineage(5)] == [4, 5]  # anchors at 1 and 4
    assert [m["version"] for m in late.lineage(3)] == [1, 2, 3]
    expected = {k: v.to(torch.bfloat16) for k, v in states[4].items()}
    assert _same_bits(late.fetch(5, sha256=_digest(client, s3, prefix, 5)), expected)


def test_uncommitted_version_is_never_a_base(client, s3, prefix):
    from grpo_steps.weights.chain import LocalCopy

    states = _training_states(3)
    writer = _writer(client, s3, prefix, anchor_every=10)
    writer.publish(states[0], 1)
    writer.commit(1)
    writer.publish(states[1], 2)  # a push some replica never loaded: not committed
    stats = writer.publish(states[2], 3)
    assert stats.base == 1
    replica = LocalCopy()
    # a replica that did load 2 replays 1 -> 3, not 2 -> 3
    _chain(client, s3, prefix).fetch(2, into=replica, sha256=_digest(client, s3, prefix, 2))
    assert _same_bits(_chain(client, s3, prefix).fetch(3, into=replica, sha256=stats.sha256), states[2])
    with pytest.raises(ValueError, match="pending"):
        writer.commit(2)
    # the publisher reuses the memory of replaced (2) and retired (1) baselines for its private copies: the
    # committed base is never among them
    writer.commit(3)
    for version, state in ((4, states[0]), (5, states[1])):
        published = writer.publish(state, version)
        writer.commit(version)
        assert _same_bits(_chain(client, s3, prefix).fetch(version, into=replica, sha256=published.sha256), state)


def _two_versions(client, s3, prefix):
    """(writer, key of version 2's only data object, its bytes): an anchor and a delta."""
    states = _training_states(2)
    writer = _writer(client, s3, prefix)
    for version in (1, 2):
        writer.publish(states[version - 1], version)
        writer.commit(version)
    manifest = writer.reader.manifest(2)
    (key,) = manifest["objects"]
    return writer, states, key, client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def _count_gets(client):
    gets = []
    client.meta.events.register("before-call.s3.GetObject", lambda params, **_: gets.append(params["url_path"]))
    return gets


def test_corrupted_delta_is_refused_after_one_more_read(client, s3, prefix):
    from grpo_steps.weights.chain import ChainCorruptError, LocalCopy, make_client

    writer, states, key, blob = _two_versions(client, s3, prefix)
    manifest = writer.reader.manifest(2)
    name, entry = next((n, e) for n, e in manifest["tensors"].items() if e["encoding"] == "xor-zstd")
    tampered = bytearray(blob)
    tampered[entry["offset"] + entry["length"] // 2] ^= 0x40  # one flipped bit inside one tensor's zstd frame
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(tampered))
    reader = _chain(make_client(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key), s3, prefix)
    gets = _count_gets(reader.client)
    copy = LocalCopy()
    with pytest.raises(ChainCorruptError) as err:
        reader.fetch(2, into=copy, sha256=_digest(client, s3, prefix, 2))
    assert name in str(err.value) and key in str(err.value)
    assert sum(key.endswith(path.split("/", 2)[-1]) for path in gets) == 2  # read, refused, read once more
    assert copy.version is None  # half-applied: labelled as no version
    client.put_object(Bucket=s3.bucket, Key=key, Body=blob)  # repaired: the next fetch replays from the anchor
    assert _same_bits(reader.fetch(2, into=copy, sha256=_digest(client, s3, prefix, 2)), states[1])
    assert copy.version == 2


class _FlipOnFirstRead:
    """An S3 client whose first GetObject of ``key`` arrives with one bit flipped at ``position`` (a transient
    corruption on the way; the stored object is intact)."""

    def __init__(self, client, key: str, position: int):
        self.client, self.key, self.position, self.flipped = client, key, position, False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def get_object(self, **kwargs):
        import io

        answer = self.client.get_object(**kwargs)
        if kwargs["Key"] == self.key and not self.flipped:
            self.flipped, body = True, bytearray(answer["Body"].read())
            body[self.position] ^= 0x01
            answer["Body"] = io.BytesIO(bytes(body))
        return answer


def test_transient_corruption_is_healed_by_the_second_read(client, s3, prefix):
    import zstandard

    from grpo_steps.weights.chain import LocalCopy

    writer, states, key, blob = _two_versions(client, s3, prefix)
    manifest = writer.reader.manifest(2)
    name, entry = next((n, e) for n, e in manifest["tensors"].items() if e["encoding"] == "xor-zstd")
    frame = blob[entry["offset"]:entry["offset"] + entry["length"]]
    good = zstandard.ZstdDecompressor().decompress(frame)

    def still_decodes(i: int) -> bool:  # a flip zstd does not notice: the delta decodes, to wrong bits
        flipped = bytearray(frame)
        flipped[i] ^= 0x01
        try:
            bad = zstandard.ZstdDecompressor().decompress(bytes(flipped))
        except zstandard.ZstdError:
            return False
        return len(bad) == len(good) and bad != good

    position = entry["offset"] + next(i for i in range(len(frame) - 1, 0, -1) if still_decodes(i))
    reader = _chain(_FlipOnFirstRead(client, key, position), s3, prefix)
    copy = LocalCopy()
    reader.fetch(1, into=copy, sha256=_digest(client, s3, prefix, 1))
    # the bad delta is XORed into the copy, refused by the checksum, XORed out again, and the second read applies
    assert _same_bits(reader.fetch(2, into=copy, sha256=_digest(client, s3, prefix, 2)), states[1])
    assert copy.version == 2


def test_manifest_names_its_checksum_algorithm(client, s3, prefix, monkeypatch):
    import json

    from grpo_steps.weights import publisher as weight_chain
    from grpo_steps.weights.chain import ChainError

    writer, states, _, _ = _two_versions(client, s3, prefix)
    assert {writer.reader.manifest(v)["checksum"] for v in (1, 2)} == {"blake3"}
    monkeypatch.setattr(weight_chain, "CHECKSUM", "sha256")  # a publisher with another algorithm: readers follow it
    stats = writer.publish(states[0], 3)
    assert writer.reader.manifest(3)["checksum"] == "sha256"
    assert _same_bits(_chain(client, s3, prefix).fetch(3, sha256=stats.sha256), states[0])
    key, manifest = f"{prefix}/manifests/{3:010d}.json", writer.reader.manifest(3, stats.sha256)
    for algorithm in ("md7", "xxh3_128"):  # unknown, or not cryptographic: refused even with the trainer's digest
        client.put_object(Bucket=s3.bucket, Key=key, Body=json.dumps({**manifest, "checksum": algorithm}).encode())
        with pytest.raises(ChainError, match=f"unknown checksum algorithm '{algorithm}'"):
            _chain(client, s3, prefix).fetch(3, sha256=_digest(client, s3, prefix, 3))


def test_truncated_object_is_refused(client, s3, prefix):
    from grpo_steps.weights.chain import ChainCorruptError

    _, _, key, blob = _two_versions(client, s3, prefix)
    client.put_object(Bucket=s3.bucket, Key=key, Body=blob[: len(blob) - 7])
    with pytest.raises(ChainCorruptError, match="truncated") as err:
        _chain(client, s3, prefix).fetch(2, sha256=_digest(client, s3, prefix, 2))
    assert key in str(err.value)


def test_version_without_manifest_does_not_exist(client, s3, prefix):
    from grpo_steps.weights.chain import VersionNotFoundError

    writer, _, _, _ = _two_versions(client, s3, prefix)
    client.delete_object(Bucket=s3.bucket, Key=f"{prefix}/manifests/{2:010d}.json")
    reader = _chain(client, s3, prefix)
    assert reader.versions() == [1] and reader.latest_version() == 1
    with pytest.raises(VersionNotFoundError, match="version 2"):
        reader.fetch(2, sha256="0" * 64)


_PUBLISHER = textwrap.dedent("""
    import sys, torch
    from grpo_steps.weights.chain import make_client
    from grpo_steps.weights.publisher import ChainPublisher
    endpoint, bucket, prefix = sys.argv[1:4]
    chain = ChainPublisher(make_client(endpoint), bucket, prefix)
    state = {f"layer{i}.weight": torch.randn(64) for i in range(300)}
    chain.publish(state, 1)
    chain.commit(1)
    print("committed 1", flush=True)
    chain.object_bytes = 1  # version 2: one object per tensor, 300 PUTs before its manifest
    chain.publish({k: v + 1 for k, v in state.items()}, 2)
    print("published 2", flush=True)
""")


def test_kill_9_mid_publish_leaves_no_visible_version(client, s3, prefix, tmp_path):
    env = {**os.environ, **s3.env()}  # credentials through the environment, never argv
    child = subprocess.Popen([sys.executable, "-c", _PUBLISHER, s3.endpoint, s3.bucket, prefix], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "committed 1"
        deadline = time.monotonic() + 30
        while not any(f"{2:010d}-" in k for k in _keys(client, s3, prefix + "/data")):
            assert time.monotonic() < deadline and child.poll() is None, child.stderr.read()
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)  # the child we started, by its PID, while version 2's data is written
        child.wait(10)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
    assert child.returncode == -signal.SIGKILL
    reader = _chain(client, s3, prefix)
    assert reader.versions() == [1]
    orphans = [k for k in _keys(client, s3, prefix) if f"data/{2:010d}-" in k]
    assert 0 < len(orphans) < 300  # the publish was cut mid-version
    assert reader.fetch(1, sha256=_digest(client, s3, prefix, 1))["layer0.weight"].shape == (64,)
    _writer(client, s3, prefix).retain([1])  # the orphaned data of the killed publish is removed
    assert not [k for k in _keys(client, s3, prefix) if f"data/{2:010d}-" in k]
    assert reader.fetch(1, sha256=_digest(client, s3, prefix, 1))["layer0.weight"].shape == (64,)


def test_retain_keeps_what_rebuilds_the_kept_versions(client, s3, prefix):
    states = _training_states(6)
    writer = _writer(client, s3, prefix, anchor_every=3)
    for version, state in enumerate(states, start=1):
        writer.publish(state, version)
        writer.commit(version)
    assert writer.retain([5]) == [1, 2, 3]  # 5 needs its anchor 4; the publisher keeps its baseline 6 too
    assert _chain(client, s3, prefix).versions() == [4, 5, 6]
    assert _writer(client, s3, prefix).retain([5]) == [6]  # another object has no baseline: only what is asked for
    assert _chain(client, s3, prefix).versions() == [4, 5]
    assert _same_bits(_chain(client, s3, prefix).fetch(5, sha256=_digest(client, s3, prefix, 5)), states[4])


def test_delete_prefix_leaves_nothing_under_the_prefix(client, s3, prefix):
    _two_versions(client, s3, prefix)
    client.put_object(Bucket=s3.bucket, Key=f"{prefix}-other/keep", Body=b"x")  # a sibling sharing the name's start
    writer = _writer(client, s3, prefix)
    assert writer.delete_prefix() > 0
    assert _keys(client, s3, prefix) == []
    assert client.get_object(Bucket=s3.bucket, Key=f"{prefix}-other/keep")["Body"].read() == b"x"


def test_unreachable_endpoint_fails_within_the_bound_naming_the_key(s3, prefix):
    from grpo_steps.processes import pick_port
    from grpo_steps.weights.chain import ChainStoreError, make_client

    dead = make_client(f"http://127.0.0.1:{pick_port('127.0.0.1', 0)}", access_key=s3.access_key,
                       secret_key=s3.secret_key, max_attempts=3, connect_timeout_s=1)
    chain = _writer(dead, s3, prefix)
    start = time.monotonic()
    with pytest.raises(ChainStoreError) as err:
        chain.publish(_training_states(1)[0], 1)
    assert time.monotonic() - start < 10  # 3 attempts, refused at once, ~50-100 ms of backoff
    assert f"s3://{s3.bucket}/{prefix}/data/{1:010d}-" in str(err.value)
    with pytest.raises(ChainStoreError, match=f"{prefix}/manifests/{1:010d}.json"):
        chain.reader.fetch(1, sha256="0" * 64)
    assert s3.secret_key not in str(err.value)
