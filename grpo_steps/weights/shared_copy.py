"""One fetch per tensor-parallel server: the workers of a vLLM server share one local copy of the weight chain.

With ``--tensor-parallel-size N`` a vLLM server runs N worker processes on one host, and each loads the *whole*
checkpoint tensors (vLLM's weight loaders slice a worker's own shard out of each full tensor). Fetching the chain on
every worker held N full copies of the model in host memory (plus N times the objects in flight) and read every object
N times from S3. Instead, rank 0 of the tensor-parallel group keeps the server's one local copy in a shared-memory
file (:class:`SharedCopy`, in ``/dev/shm``, unlinked as soon as every worker has mapped it: a server killed later
leaves nothing behind, and the file of one killed during set-up is removed by the next, :func:`remove_stale`) and
fetches into it as before (:meth:`grpo_steps.weights.chain.WeightChain.fetch`, decoding each
object into the copy's tensors as it arrives). The other workers map the same pages: no copy, no S3 call.

Every worker still checks what it loads (:func:`share_version`): rank 0 sends the manifest bytes it fetched over the
group's CPU (gloo) process group, and each other worker checks them against the digest in *its own* update request
(the trainer's, behind the run's token), checks the manifest's bounds and the served model's layout, and checks every
tensor of the shared copy against the manifest's BLAKE3 checksum. A version any worker refuses is refused by all of
them before any of them loads a tensor, so a server never serves a mix of two versions and keeps the weights it served.

Host memory per server: one copy (``M``, the model's serving size) plus rank 0's fetch buffers, instead of ``N`` of
each (docs/weight-sync.md, "Host memory"). Every worker must see rank 0's file: a group that spans hosts (or a
``/dev/shm`` too small for ``M``) is found at set-up (:func:`share_setup`) and each worker then fetches its own copy,
as before, said once on stderr.

Pure: numpy-free, torch and the standard library (``torch.distributed`` only through the group handed in), and
:mod:`grpo_steps.weights.manifest`, so the vLLM worker extension and a test's plain gloo group run the same code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import re
import secrets
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor

from grpo_steps.weights.manifest import DTYPES, ChainRefusedError, check_manifest, refuse, same_layout, tensor_checksum

ALIGN = 64
"""Byte alignment of each tensor in the shared file (a cache line; every dtype's width divides it)."""
HEADER = 64
"""Bytes before the first tensor: a random nonce, by which a worker knows it mapped rank 0's very file."""
NONCE = 16
HEADROOM = 512 << 20
"""Bytes of ``/dev/shm`` a shared copy leaves free: NCCL's shared-memory transport (tensor parallelism on one host)
and every other user of the tmpfs allocate there after us; a copy that fills it to the last page made their next
allocation fail (SIGBUS or an NCCL error) instead of ours falling back to a copy per worker."""
PREFIX = "grpo-weights-"
"""A shared file's name: ``grpo-weights-<pid of rank 0>-<random>``; the pid lets a later server remove a file that a
server killed during set-up (after ``create``, before every rank mapped it and rank 0 unlinked it) left behind."""
_STALE = re.compile(re.escape(PREFIX) + r"(\d+)-")


def packing(layout: dict) -> tuple[dict[str, tuple[int, str, tuple[int, ...]]], int]:
    """Where each tensor of ``layout`` (``{name: (dtype name, shape)}``, the served model's: dtypes as a manifest names
    them) lies in a :class:`SharedCopy`: ``({name: (byte offset, dtype, shape)}, file size in bytes)``, names in
    sorted order, each at a multiple of :data:`ALIGN` after a :data:`HEADER`. Every worker computes the same.

    >>> packing({"b": ("float32", (3,)), "a": ("bfloat16", (2, 2))})
    ({'a': (64, 'bfloat16', (2, 2)), 'b': (128, 'float32', (3,))}, 140)
    """
    offsets, at = {}, HEADER
    for name in sorted(layout):
        dtype, shape = layout[name]
        at = -(-at // ALIGN) * ALIGN
        offsets[name] = (at, dtype, tuple(shape))
        at += DTYPES[dtype] * math.prod(shape)
    return offsets, at


class SharedCopy:
    """The tensors of one version in a shared-memory file, mapped read-write by every worker of a server: ``tensors``
    (name -> CPU tensor, a view of the mapping; the dtypes and shapes of the layout). Rank 0 writes them (its
    :class:`grpo_steps.weights.chain.LocalCopy` holds these very tensors), the others only read them while rank 0
    does not write (inside :func:`share_version`)."""

    def __init__(self, fd: int, layout: dict, path: str) -> None:
        import torch

        self.offsets, size = packing(layout)
        self.path, self._map = path, mmap.mmap(fd, size)
        self.nonce = bytes(self._map[:NONCE])
        self.tensors = {}
        for name, (offset, dtype, shape) in self.offsets.items():
            count = DTYPES[dtype] * math.prod(shape)
            raw = (torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=offset) if count
                   else torch.empty(0, dtype=torch.uint8))
            self.tensors[name] = raw.view(getattr(torch, dtype)).view(shape)

    @classmethod
    def create(cls, layout: dict, directory: str = "/dev/shm") -> SharedCopy:
        """A new file in ``directory`` (mode 0600, a fresh name: ``O_EXCL``, no link followed) of :func:`packing`'s
        size, its pages reserved now (``posix_fallocate``: a tmpfs too small fails here with ENOSPC instead of killing
        the worker with SIGBUS at a later write), with a fresh nonce in its header. First removes what a killed server
        of this user left there (:func:`remove_stale`); refused when it would leave less than :data:`HEADROOM` free.

        Raises:
            OSError: the file cannot be made or reserved, or would leave too little room (nothing is left behind).
        """
        size = packing(layout)[1]
        remove_stale(directory)
        room = os.statvfs(directory)
        free = room.f_bavail * room.f_frsize
        if size + HEADROOM > free:
            raise OSError(f"{directory} has {free / 2**30:.2f} GiB free: a shared copy of {size / 2**30:.2f} GiB would "
                          f"leave less than {HEADROOM >> 20} MiB for NCCL and the host")
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        try:
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, secrets.token_bytes(NONCE), 0)
            return cls(fd, layout, path)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the file

    @classmethod
    def attach(cls, path: str, layout: dict, nonce: bytes) -> SharedCopy:
        """Map rank 0's file ``path``: refused unless it is a regular file (not followed if a link), of this user,
        of the layout's size, with ``nonce`` in its header (else it is not rank 0's: another host's ``/dev/shm``).

        Raises:
            OSError: it cannot be opened, or is not rank 0's file (says which check failed).
        """
        size = packing(layout)[1]
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size != size:
                raise OSError(f"{path} is not a regular file of this user of {size} bytes")
            copy = cls(fd, layout, path)
        finally:
            os.close(fd)
        if copy.nonce != nonce:
            copy.close()
            raise OSError(f"{path} is not rank 0's file (another host's /dev/shm?)")
        return copy

    def close(self) -> None:
        """Drop the tensors and the mapping (after every other reference to the tensors is gone)."""
        self.tensors = {}
        try:
            self._map.close()
        except BufferError:  # a tensor still referenced elsewhere: the mapping goes with it
            pass


def remove_stale(directory: str) -> list[str]:
    """Remove the shared files in ``directory`` that a server of this user left when it was killed during
    :func:`share_setup`: regular files (a link is never followed nor removed) of this user named
    :data:`PREFIX` ``<pid>-...`` whose process is gone. Returns the paths removed. A pid in use again by another
    process keeps its file (it may be that process's own): nothing of a live server is ever removed."""
    removed = []
    for name in os.listdir(directory):
        found = _STALE.match(name)
        if found is None:
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:  # its server is gone: nobody maps it by name any more
            with contextlib.suppress(FileNotFoundError):  # another server's sweep took it first
                os.unlink(path)
                removed.append(path)
        except (FileNotFoundError, PermissionError):  # gone already; a live process of another user holds the pid
            continue
    return removed


def _leader(group) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)


def share_setup(group, layout: dict | None, directory: str = "/dev/shm") -> tuple[SharedCopy | None, str | None]:
    """Collective over ``group`` (a ``torch.distributed`` CPU process group, gloo: vLLM's tensor-parallel group's
    ``cpu_group``): rank 0 makes a :class:`SharedCopy` of ``layout`` (the served model's ``{name: (dtype, shape)}``)
    in ``directory`` and every other rank maps it; then rank 0 unlinks the file (the mappings keep it).

    Returns ``(the shared copy, None)`` on every rank, or ``(None, why)`` on every rank when any rank could not take
    part: no layout (the served checkpoint's files were not found), rank 0 could not make the file, or a rank could not
    map it (another host). Then each worker fetches its own copy.
    """
    import torch.distributed as dist

    rank, shared, why = dist.get_rank(group), None, None
    offer = [None, None, None]  # path, nonce, why not
    if rank == 0:
        if layout is None:
            offer[2] = "the served model's tensors are unknown (no checkpoint files found)"
        else:
            try:
                shared = SharedCopy.create(layout, directory)
                offer[:2] = shared.path, shared.nonce
            except (OSError, KeyError) as err:  # KeyError: a dtype a manifest cannot name
                offer[2] = f"no shared file in {directory}: {type(err).__name__}: {err}"
    dist.broadcast_object_list(offer, src=_leader(group), group=group)
    if rank != 0 and offer[0] is not None:
        try:
            shared = SharedCopy.attach(offer[0], layout, offer[1])
        except OSError as err:
            why = f"rank {rank} could not map {offer[0]}: {err}"
    answers = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, offer[2] if rank == 0 else why, group=group)
    if rank == 0 and shared is not None:
        os.unlink(shared.path)  # every rank has mapped it, or failed to: nothing is left in /dev/shm after a kill
    problems = [a for a in answers if a]
    if problems:
        if shared is not None:
            shared.close()
        return None, "; ".join(problems)
    return shared, None


def share_version(group, shared: SharedCopy, fetch, *, version: int, sha256: str, prefix: str,
                  layout: dict) -> dict:
    """Collective over ``group``: bring the server's shared copy to chain version ``version`` and check it on every
    rank. Rank 0 calls ``fetch()`` (it fetches into ``shared.tensors`` and returns the manifest bytes of ``version``,
    already checked against ``sha256``); the other ranks pass ``fetch=None``, get those bytes from rank 0 and check
    them themselves: their SHA-256 against ``sha256`` (the digest of this rank's own update request), the manifest's
    bounds (:func:`check_manifest`, ``prefix``: the chain's, ending in ``/``), ``layout`` (the served model's
    ``{name: (dtype, shape)}``), and each shared tensor's checksum against the manifest's.

    Returns ``shared.tensors`` on every rank, only when every rank accepted the version.

    Raises:
        ChainError: on every rank, when any rank refused the version (rank 0's own error on rank 0 when its fetch
            failed; else a :class:`ChainRefusedError` naming the ranks and why). Nothing is loaded by any rank.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    status, failure = [None, None], None  # the manifest's bytes, rank 0's error
    if rank == 0:
        try:
            status[0] = fetch()
        except Exception as err:  # noqa: BLE001  (raised below, after the others are told)
            failure, status[1] = err, f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(status, src=_leader(group), group=group)
    if status[1] is not None:  # every rank raises: none waits for a collective the others never reach
        if failure is not None:
            raise failure
        raise ChainRefusedError(f"weight version {version} refused: rank 0 of the tensor-parallel group did not "
                                f"fetch it: {status[1]}")
    problem = None
    if rank != 0:
        try:
            check_shared(shared, status[0], version=version, sha256=sha256, prefix=prefix, layout=layout)
        except (ChainRefusedError, ValueError, KeyError) as err:
            problem = f"rank {rank}: {err}"
    answers = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, problem, group=group)
    problems = [a for a in answers if a]
    if problems:
        raise ChainRefusedError(f"weight version {version} refused by the tensor-parallel group: "
                                f"{'; '.join(problems)}")
    return shared.tensors


def check_shared(shared: SharedCopy, body: bytes, *, version: int, sha256: str, prefix: str, layout: dict) -> None:
    """What a worker that did not fetch checks before it loads the shared copy (see :func:`share_version`).

    Raises:
        ChainRefusedError: ``body`` is not the manifest of ``sha256``, breaks a bound or the layout, or a tensor's
            checksum differs from the manifest's (names the tensor).
    """
    digest = hashlib.sha256(body).hexdigest()
    if digest != sha256:
        raise refuse(version, f"the manifest rank 0 fetched is not the one the trainer published (SHA-256 "
                              f"{digest[:16]}..., the request's {sha256[:16]}...)")
    manifest = check_manifest(json.loads(body), version, prefix)
    same_layout(manifest, layout, "the served model")
    names = list(manifest["tensors"])
    # on threads: BLAKE3 releases the GIL (one thread hashed ~2.1 GB/s on the 2-core box: 7 s for a 7B model in bf16)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        sums = list(pool.map(lambda n: tensor_checksum(shared.tensors[n], manifest["checksum"]), names))
    wrong = [n for n, got in zip(names, sums, strict=True) if got != manifest["tensors"][n]["checksum"]]
    if wrong:
        raise refuse(version, f"tensors {wrong[:3]} of the shared copy differ from the manifest's "
                              f"{manifest['checksum']} checksums")
