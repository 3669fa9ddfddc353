"""One fetch per tensor-parallel server (grpo_steps/weights/shared_copy.py), with two real processes in a real gloo
group, as vLLM's tensor-parallel workers are, on the real S3 server (SeaweedFS), through the very functions the vLLM
worker calls (``share_setup``, ``share_version``). Rank 1 gets no S3 endpoint or credentials at all: it can only read
what rank 0 fetched. A real vLLM server with ``--tensor-parallel-size 2`` is tests/integration/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.s3


def _states() -> list[dict]:
    import torch

    torch.manual_seed(0)
    first = {"embed.weight": torch.randn(64, 16), "norm.weight": torch.ones(16), "head.bias": torch.zeros(7)}
    return [{k: v + 0.01 * i * torch.randn_like(v) for k, v in first.items()} for i in range(3)]


def _rank(rank: int, out: str, store: dict | None, prefix: str, layout: dict, requests: list) -> None:
    """One worker: join the group, set up the shared copy, then take each request ``(version, sha256, tamper)`` as
    the engine does; writes what it saw to ``out/rank<rank>.json``."""
    import torch.distributed as dist

    from grpo_steps.weights.chain import LocalCopy, WeightChain, make_client
    from grpo_steps.weights.manifest import tensor_checksum
    from grpo_steps.weights.shared_copy import share_setup, share_version

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")  # as vLLM's TP group's cpu_group: a group of its own
    seen = {"setup_without_layout": share_setup(group, None, out)[1]}
    shared, why = share_setup(group, layout, out)
    dist.barrier(group)  # both have returned from the set-up
    seen.update(setup=why, files_left=sorted(f for f in os.listdir(out) if f.startswith("grpo-weights-")), results=[])
    chain = copy = None
    if rank == 0:
        chain = WeightChain(make_client(store["endpoint_url"], access_key=store["key"], secret_key=store["secret"],
                                        max_attempts=2), store["bucket"], store["prefix"])
        copy = LocalCopy(tensors=dict(shared.tensors))
    for version, sha256, tamper, *own_digest in requests:
        sha256 = own_digest[0] if own_digest and rank else sha256  # what this rank's own request names
        def fetch(version=version, sha256=sha256, tamper=tamper) -> bytes:
            chain.fetch(version, copy, sha256=sha256, layout=layout)
            if tamper:  # what rank 0 hands over is not what the manifest says (a bug, or a writer of /dev/shm)
                copy.tensors["norm.weight"][0] += 1
            return copy.manifest

        try:
            tensors = share_version(group, shared, fetch if rank == 0 else None, version=version, sha256=sha256,
                                    prefix=prefix, layout=layout)
            seen["results"].append({"checksums": {n: tensor_checksum(t) for n, t in tensors.items()},
                                    "bytes_read": chain.bytes_read if chain else 0})
        except Exception as err:  # noqa: BLE001  (what the test asserts)
            seen["results"].append({"error": f"{type(err).__name__}: {err}"})
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(seen, f)
    shared.close()
    dist.destroy_process_group()


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_rank_0_fetches_once_and_every_rank_checks_and_refuses_together(client, s3, tmp_path):
    import torch.multiprocessing as mp

    from grpo_steps.weights.manifest import tensor_checksum
    from grpo_steps.weights.publisher import ChainPublisher

    prefix, states = "weights/tp", _states()
    writer = ChainPublisher(client, s3.bucket, prefix, anchor_every=10)
    digests = {}
    for version, state in enumerate(states, start=1):
        digests[version] = writer.publish(state, version).sha256
        writer.commit(version)
    layout = {n: ("float32", tuple(t.shape)) for n, t in states[0].items()}
    requests = [(1, digests[1], False),  # the anchor
                (2, digests[2], False),  # a delta
                (3, digests[2], False),  # a digest that is not version 3's: the trainer did not publish it
                (3, digests[3], True),  # rank 0 hands over a tensor other than the manifest's
                (2, digests[2], False, digests[1])]  # rank 1's request names another version's digest than rank 0's
    store = {"endpoint_url": s3.endpoint, "key": s3.access_key, "secret": s3.secret_key, "bucket": s3.bucket,
             "prefix": prefix}
    mp.start_processes(_run, args=(str(tmp_path), store, layout, requests), nprocs=2, start_method="spawn")
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert [s["setup"] for s in seen] == [None, None]
    assert all("unknown" in s["setup_without_layout"] for s in seen)  # refused on both: each then fetches its own
    assert seen[0]["files_left"] == seen[1]["files_left"] == []  # unlinked once both mapped it
    for version in (1, 2):  # every tensor reaches both ranks, read from S3 once (rank 1 has no S3 at all)
        expected = {n: tensor_checksum(t.contiguous()) for n, t in states[version - 1].items()}
        first, second = (s["results"][version - 1] for s in seen)
        assert first["checksums"] == second["checksums"] == expected
        assert first["bytes_read"] > 0 and second["bytes_read"] == 0
    forged = [s["results"][2]["error"] for s in seen]
    assert "is not the one the trainer published" in forged[0]
    assert "rank 0 of the tensor-parallel group did not fetch it" in forged[1] and "trainer published" in forged[1]
    tampered = [s["results"][3]["error"] for s in seen]
    assert all("refused by the tensor-parallel group: rank 1" in e and "norm.weight" in e for e in tampered)
    other = [s["results"][4]["error"] for s in seen]  # rank 1 checks rank 0's manifest against its own request
    assert all("rank 1" in e and "is not the one the trainer published" in e for e in other)


def _run(rank: int, out: str, store: dict, layout: dict, requests: list) -> None:
    _rank(rank, out, store if rank == 0 else None, store["prefix"] + "/", layout, requests)


def test_a_file_left_by_a_killed_server_is_removed_and_nothing_else(tmp_path):
    """A server killed during set-up left its shared file in /dev/shm (model-sized, until reboot): the next server's
    set-up removes it, but never a live server's file, a link (nor its target) or another name."""
    import subprocess
    import sys

    from grpo_steps.weights.shared_copy import PREFIX, SharedCopy

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is free now: the "killed server"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    left = tmp_path / f"{PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{PREFIX}{os.getpid()}-def"
    link = tmp_path / f"{PREFIX}{gone.pid}-lnk"
    other = tmp_path / "grpo-weightsx-1-x"
    for path in (left, live, other):
        path.write_bytes(b"\0" * 64)
    link.symlink_to(victim)
    shared = SharedCopy.create({"w": ("float32", (4,))}, str(tmp_path))
    try:
        assert not left.exists()
        assert live.exists() and link.is_symlink() and victim.read_text() == "keep" and other.exists()
        assert os.path.basename(shared.path).startswith(f"{PREFIX}{os.getpid()}-")
        assert os.stat(shared.path).st_mode & 0o777 == 0o600
    finally:
        os.unlink(shared.path)
        shared.close()


def test_a_shared_copy_that_would_fill_its_tmpfs_is_refused_before_it_takes_a_page(tmp_path):
    """/dev/shm filled to the last page broke NCCL's next allocation: a copy that would leave less than HEADROOM
    free is refused (share_setup then lets each worker fetch its own), before anything is reserved."""
    from grpo_steps.weights.shared_copy import HEADER, HEADROOM, PREFIX, SharedCopy

    room = os.statvfs(tmp_path)
    free = room.f_bavail * room.f_frsize
    too_big = {"w": ("int8", (free - HEADROOM // 2 - HEADER,))}  # fits the disk, not with the headroom
    with pytest.raises(OSError, match=r"GiB free: a shared copy of .* would leave less than 512 MiB"):
        SharedCopy.create(too_big, str(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(PREFIX)]
