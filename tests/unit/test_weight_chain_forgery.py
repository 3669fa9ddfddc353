"""A writer of the bucket who is not the trainer, against the weight chain (grpo_steps/weights/chain.py) on the real S3
server (SeaweedFS): a swapped manifest with a consistent forged payload, a rewritten lineage, a self-referencing base,
an undersized object, a key outside the version's prefix, a missing tensor, an unknown format, a tag field of the
wrong type. Each is refused with an error that names it, before anything is applied: the replica's copy keeps the
version it held. The trainer's own walks (``committed()``'s manifest, ``retain()``) stay bounded on a forged lineage.
"""

from __future__ import annotations

import hashlib
import json

import pytest

pytestmark = pytest.mark.s3


@pytest.fixture
def prefix(request):
    return f"forgery/{request.node.name}"


def _states(n: int) -> list[dict]:
    import torch

    torch.manual_seed(0)
    first = {"embed.weight": torch.randn(64, 16), "norm.weight": torch.ones(16), "head.bias": torch.zeros(64)}
    return [{k: v + 0.01 * i * torch.randn_like(v) for k, v in first.items()} for i in range(n)]


def _chain(client, s3, prefix, **kw):
    from grpo_steps.weights.chain import WeightChain

    return WeightChain(client, s3.bucket, prefix, **kw)


def _writer(client, s3, prefix, **kw):
    from grpo_steps.weights.publisher import ChainPublisher

    return ChainPublisher(client, s3.bucket, prefix, **kw)


def _trainer(client, s3, prefix):
    """A trainer's chain with versions 1 (anchor) and 2 (delta) committed; returns it, the states and the digests."""
    writer, states = _writer(client, s3, prefix, anchor_every=3), _states(3)
    digests = {}
    for version in (1, 2):
        digests[version] = writer.publish(states[version - 1], version).sha256
        writer.commit(version)
    return writer, states, digests


def _put_manifest(client, s3, prefix, version: int, manifest: dict) -> str:
    body = json.dumps(manifest).encode()
    client.put_object(Bucket=s3.bucket, Key=f"{prefix}/manifests/{version:010d}.json", Body=body)
    return hashlib.sha256(body).hexdigest()


def _gets(client) -> list:
    gets = []
    client.meta.events.register("before-call.s3.GetObject", lambda params, **_: gets.append(params["url_path"]))
    return gets


def _layout(state: dict) -> dict:
    return {name: (None, tuple(t.shape)) for name, t in state.items()}


def test_a_swapped_version_with_a_consistent_payload_is_refused_and_the_copy_kept(client, s3, prefix):
    import torch

    from grpo_steps.weights.chain import ChainRefusedError, LocalCopy

    _, states, digests = _trainer(client, s3, prefix)
    replica = LocalCopy()
    _chain(client, s3, prefix).fetch(1, into=replica, sha256=digests[1])
    held = {k: v.clone() for k, v in replica.tensors.items()}
    forged = {k: torch.full_like(v, 7.0) for k, v in states[1].items()}
    _writer(client, s3, prefix).publish(forged, 2)  # the attacker's own chain object: manifest and data consistent
    with pytest.raises(ChainRefusedError, match="weight version 2 refused: its manifest .* is not the one the trainer"):
        _chain(client, s3, prefix).fetch(2, into=replica, sha256=digests[2])
    assert replica.version == 1 and all(torch.equal(replica.tensors[k], v) for k, v in held.items())


def test_a_rewritten_lineage_is_refused_link_by_link(client, s3, prefix):
    import torch

    from grpo_steps.weights.chain import ChainRefusedError, LocalCopy

    writer, states, digests = _trainer(client, s3, prefix)
    anchor = writer.reader.manifest(1, digests[1])
    # the anchor rewritten under its own publish id: a late replica replaying from it would load other weights
    _put_manifest(client, s3, prefix, 1, {**anchor, "tensors": {
        n: {**e, "checksum": "0" * 64} if n == "norm.weight" else e for n, e in anchor["tensors"].items()}})
    late = LocalCopy()
    with pytest.raises(ChainRefusedError, match="its base, version 1, is not the manifest it was built on"):
        _chain(client, s3, prefix).fetch(2, into=late, sha256=digests[2])
    assert late.version is None and late.tensors == {}
    # rewritten by another publish (consistent data, a new id): not the base the delta names either
    _writer(client, s3, prefix).publish({k: torch.full_like(v, 7.0) for k, v in states[0].items()}, 1)
    with pytest.raises(ChainRefusedError, match="its base, version 1, is not the manifest .* published again"):
        _chain(client, s3, prefix).fetch(2, into=late, sha256=digests[2])
    assert late.version is None and late.tensors == {}
    # bytes that are no manifest at all: refused by their digest, never parsed (no "not JSON", no bound named)
    client.put_object(Bucket=s3.bucket, Key=f"{prefix}/manifests/{1:010d}.json", Body=b"\xff{not json")
    with pytest.raises(ChainRefusedError, match="its base, version 1, is not the manifest it was built on") as err:
        _chain(client, s3, prefix).fetch(2, into=late, sha256=digests[2])
    assert "JSON" not in str(err.value)


def test_a_fetch_without_the_trainers_digest_is_refused(client, s3, prefix):
    from grpo_steps.weights.chain import LocalCopy

    _trainer(client, s3, prefix)
    copy = LocalCopy()
    for missing in (None, "", "ab" * 31, "AB" * 32):  # none, empty, short, not lowercase hex
        with pytest.raises(ValueError, match="needs sha256, the SHA-256 of its manifest as the trainer published it"):
            _chain(client, s3, prefix).fetch(2, into=copy, sha256=missing)
    assert copy.version is None and copy.tensors == {}


def test_a_self_referencing_base_is_refused_at_once_on_every_walk(client, s3, prefix):
    from grpo_steps.weights.chain import ChainRefusedError

    writer, _, digests = _trainer(client, s3, prefix)
    manifest = writer.reader.manifest(2, digests[2])
    forged = _put_manifest(client, s3, prefix, 2, {**manifest, "base": {**manifest["base"], "version": 2}})
    reader = _chain(client, s3, prefix)
    gets = _gets(reader.client)
    for walk in (lambda: reader.fetch(2, sha256=forged),  # even with the forged manifest's own digest
                 lambda: reader.manifest(2),  # the trainer's committed() reads this
                 lambda: _writer(reader.client, s3, prefix).retain([2])):  # and its retention walks lineages
        with pytest.raises(ChainRefusedError, match="a delta's base must be .*older than this one"):
            walk()
    assert len(gets) <= 3  # one manifest read per walk: no loop (it was 53k GETs in 2 s)


def test_a_depth_that_does_not_follow_its_base_is_refused(client, s3, prefix):
    from grpo_steps.weights.chain import ChainRefusedError

    writer, _, digests = _trainer(client, s3, prefix)
    manifest = writer.reader.manifest(2, digests[2])
    forged = _put_manifest(client, s3, prefix, 2, {**manifest, "anchor": 0})
    with pytest.raises(ChainRefusedError, match="has depth 0 and anchor 1, it has depth 1 and anchor 0"):
        _chain(client, s3, prefix).fetch(2, sha256=forged)


def test_an_undersized_object_is_refused_before_it_is_read(client, s3, prefix):
    from grpo_steps.weights.chain import ChainCorruptError

    writer, _, digests = _trainer(client, s3, prefix)
    (key,) = writer.reader.manifest(2, digests[2])["objects"]
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"\0" * 2048)
    with pytest.raises(ChainCorruptError, match=r"has 2048 bytes, the manifest says \d+ \(truncated or replaced\)"):
        _chain(client, s3, prefix).fetch(2, sha256=digests[2])


@pytest.mark.parametrize(("change", "error"), [
    (lambda m: {**m, "objects": {k.replace("/data/", "/../other/data/"): n for k, n in m["objects"].items()}},
     "an object's key is not under"),
    (lambda m: {**m, "format": 4}, "manifest format 4, this reader reads 3"),
    (lambda m: {**m, "anchor": "1"}, "its anchor is not at least depth versions back"),  # a tag's field, typed
    (lambda m: {**m, "objects": {k: n * 4096 for k, n in m["objects"].items()}},
     "an object's size is not the sum of its frames' lengths"),
    (lambda m: {**m, "tensors": {n: {**e, "length": 1 << 30} if e.get("key") else e
                                 for n, e in m["tensors"].items()}}, "its frame is out of bounds"),
], ids=["key-outside-prefix", "unknown-format", "anchor-not-int", "object-size", "frame-length"])
def test_a_forged_field_is_refused_with_its_name(client, s3, prefix, change, error):
    """Refused even with the forged manifest's own digest (the bounds hold on their own), and on the trainer's reads."""
    from grpo_steps.weights.chain import ChainRefusedError

    writer, _, digests = _trainer(client, s3, prefix)
    forged = _put_manifest(client, s3, prefix, 2, change(writer.reader.manifest(2, digests[2])))
    with pytest.raises(ChainRefusedError, match=error):
        _chain(client, s3, prefix).fetch(2, sha256=forged)
    with pytest.raises(ChainRefusedError, match=error):  # the trainer's own read of it too
        writer.reader.manifest(2)


def test_a_delta_claiming_a_larger_tensor_than_its_base_is_refused(client, s3, prefix):
    """A 2 KB frame passed off as a 64 MiB tensor: the delta's layout must be its base's (and the served model's)."""
    from grpo_steps.weights.chain import ChainRefusedError

    writer, _, digests = _trainer(client, s3, prefix)
    manifest = writer.reader.manifest(2, digests[2])
    forged = _put_manifest(client, s3, prefix, 2, {**manifest, "tensors": {
        n: {**e, "shape": [4096, 4096]} if n == "embed.weight" else e for n, e in manifest["tensors"].items()}})
    with pytest.raises(ChainRefusedError, match=r"tensor embed.weight is float32 \(4096, 4096\), its base"):
        _chain(client, s3, prefix).fetch(2, sha256=forged)


def test_a_version_missing_a_tensor_is_refused_against_the_served_layout(client, s3, prefix):
    from grpo_steps.weights.chain import ChainRefusedError, LocalCopy

    states = _states(1)
    writer = _writer(client, s3, prefix)
    partial = {k: v for k, v in states[0].items() if k != "head.bias"}
    digest = writer.publish(partial, 1).sha256  # the trainer's own digest: the check is the layout's, not the link's
    replica = LocalCopy()
    with pytest.raises(ChainRefusedError, match=r"missing \['head.bias'\]"):
        _chain(client, s3, prefix).fetch(1, into=replica, sha256=digest, layout=_layout(states[0]))
    assert replica.version is None and replica.tensors == {}
    assert _chain(client, s3, prefix).fetch(1, sha256=digest, layout=_layout(partial)).keys() == partial.keys()


def test_a_version_in_another_dtype_than_the_served_model_is_refused(client, s3, prefix, tiny_model_path):
    """Names, shapes and dtypes: the served model's layout (grpo_steps.weights.layout.served_layout, read from the tiny
    model's files, served in bfloat16) refuses a version published in float16 on the chain path, and a directory in
    float16 on the directory path (disk pushes, the direct CPU load); the serving dtype passes both, and a directory
    may hold the checkpoint's own float32 (the evaluate step's baseline). The load would otherwise cast silently."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    from grpo_steps.weights.chain import ChainRefusedError, LocalCopy
    from grpo_steps.weights.layout import check_layout, served_layout

    config = SimpleNamespace(model_config=SimpleNamespace(model=tiny_model_path, revision=None, dtype=torch.bfloat16))
    layout, file_dtypes = served_layout(config)
    files = load_file(f"{tiny_model_path}/model.safetensors")
    assert layout == {n: ("bfloat16", tuple(t.shape)) for n, t in files.items()}
    assert set(file_dtypes.values()) == {"float32"}
    name = sorted(files)[0]

    half = {n: t.to(torch.float16) for n, t in files.items()}
    digest = _writer(client, s3, prefix, dtype=torch.float16).publish(half, 1).sha256  # the trainer's own digest
    replica = LocalCopy()
    with pytest.raises(ChainRefusedError, match=rf"tensor {name} is float16 .*, the served model has bfloat16"):
        _chain(client, s3, prefix).fetch(1, into=replica, sha256=digest, layout=layout)
    assert replica.version is None and replica.tensors == {}  # nothing read, nothing applied
    digest = _writer(client, s3, f"{prefix}-bf16", dtype=torch.bfloat16).publish(files, 1).sha256  # cast on publish
    served = _chain(client, s3, f"{prefix}-bf16").fetch(1, sha256=digest, layout=layout)
    assert {t.dtype for t in served.values()} == {torch.bfloat16}

    with pytest.raises(ValueError, match=rf"other dtype \['{name} float16 \(served bfloat16\)'"):
        check_layout(half, layout, "/push/v1", file_dtypes)
    check_layout({n: t.to(torch.bfloat16) for n, t in files.items()}, layout, "/push/v1", file_dtypes)
    check_layout(files, layout, "/base", file_dtypes)  # the files the server started from
    with pytest.raises(ValueError, match=rf"missing \['{name}'\]"):
        check_layout({n: t for n, t in files.items() if n != name}, layout, "/push/v2", file_dtypes)
