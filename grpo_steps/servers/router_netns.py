"""The router's private network namespace (:mod:`grpo_steps.servers.router_bridge` runs the relays): a forked child
of the bridge, the namespace's *keeper*, moves into a new network namespace whose only interface is its own loopback
(``unshare(CLONE_NEWNET)``; without root also ``CLONE_NEWUSER``, mapping this user to itself), binds a listener per
worker where the router will reach it (:func:`inside_addresses`), hands those to the bridge over a unix socket pair
(``SCM_RIGHTS``), starts the router (``--host`` :data:`ROUTER_HOST` ``--port`` :data:`ROUTER_PORT`) and then makes
connections inside the namespace on the bridge's request, until the router exits or the bridge is gone. Only the
standard library: the bridge's process imports nothing heavy.

The channel is a ``SOCK_SEQPACKET`` pair (one message per request or answer, never two run together). A request is
:func:`request` (the port and the request's id); its answer :func:`answer` echoes the id, so an answer that arrives
after the bridge gave up on its request (a keeper descheduled past the bridge's connect timeout) is recognised and
dropped, never taken for the next request's (it once was: from then on every connection got the previous request's
socket, and a token-less ``GET /metrics`` reached the router's main port).
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import select
import signal
import socket
import struct
import subprocess
import urllib.parse

TOKEN_ENV = "GRPO_SERVER_TOKEN"  # as grpo_steps.servers.auth (not imported: this process imports nothing heavy)
ROUTER_HOST = "127.2.0.1"
"""The router's address inside its namespace: a loopback address no worker keeps (:func:`inside_addresses`)."""
ROUTER_PORT = 8000
"""The router's port inside its namespace (the namespace is fresh: every port is free)."""
ROUTER_METRICS_PORT = 9000
"""The router's Prometheus port inside its namespace."""
NO_NAMESPACE_EXIT = 3
"""Exit code when no private network namespace can be made here."""

REQUEST_BYTES = 15
"""A request on the channel: the port (5 ASCII digits) and the request's id (10 ASCII digits)."""

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def inside_addresses(worker_urls: list[str]) -> list[tuple[str, int]]:
    """Where the router reaches each worker inside its namespace: a loopback address keeps its address and port
    (but :data:`ROUTER_HOST`); any other host (a name, another machine) gets ``127.1.0.<k+1>`` (loopback covers
    ``127.0.0.0/8``).

    >>> inside_addresses(["http://127.0.0.1:8001", "http://10.0.0.5:8000", "http://localhost:8002"])
    [('127.0.0.1', 8001), ('127.1.0.2', 8000), ('127.0.0.1', 8002)]
    """
    out = []
    for k, url in enumerate(worker_urls):
        parts = urllib.parse.urlsplit(url)
        host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname or ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback and ipaddress.ip_address(host).version == 4
        except ValueError:
            loopback = False
        out.append((host if loopback and host != ROUTER_HOST else f"127.1.0.{k + 1}", parts.port or 80))
    return out


def inside_urls(worker_urls: list[str]) -> list[str]:
    """The worker URLs the router is given inside its namespace (see :func:`inside_addresses`).

    >>> inside_urls(["http://127.0.0.1:8001", "http://example.org:8000"])
    ['http://127.0.0.1:8001', 'http://127.1.0.2:8000']
    """
    return [f"http://{host}:{port}" for host, port in inside_addresses(worker_urls)]


def channel() -> tuple[socket.socket, socket.socket]:
    """The bridge's and the keeper's ends of their channel: a unix ``SOCK_SEQPACKET`` pair (message boundaries kept)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def request(port: int, request_id: int) -> bytes:
    """The bridge's request for a connection to ``port`` in the namespace.

    >>> request(8000, 7)
    b'080000000000007'
    """
    return f"{port:05d}{request_id % 10**10:010d}".encode()


def answer(ok: bool, message: bytes) -> bytes:
    """The keeper's answer to the request ``message``: ``ok`` or ``no``, then the request's id.

    >>> answer(True, request(9000, 12)), answer(False, request(9000, 12))
    (b'ok0000000012', b'no0000000012')
    """
    return (b"ok" if ok else b"no") + message[5:REQUEST_BYTES]


def _unshare_network() -> None:
    """Move this (single-threaded) process into a new network namespace (and, without root, a new user namespace
    mapping this user to itself), with its loopback up. Raises OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    if flags & _CLONE_NEWUSER:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # `ip link set lo up`, as an ioctl
        request = struct.pack("16sH22x", b"lo", 0)  # struct ifreq: name, flags, padding to 40 bytes
        flags_now = struct.unpack("16sH22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags_now | _IFF_UP))


def keeper(ctl: socket.socket, workers: list[tuple[str, int]], router_cmd: list[str],
           connect_timeout_s: float = 5.0) -> int:
    """The namespace's keeper (a forked child): make the namespace, hand the relay a listener per worker, start the
    router, then make connections inside the namespace on request (:func:`request`; :func:`answer` ``ok`` with the
    socket, or ``no``) until the router exits or the relay is gone. ``connect_timeout_s``: seconds one connection may
    take, below the bridge's own wait for the answer (so the answer normally comes in time; when it does not, its id
    tells the bridge to drop it). Returns the exit code."""
    try:
        _unshare_network()
    except OSError as err:
        ctl.sendall(f"no private network namespace for the router here ({err}): run as root, allow unprivileged "
                    "user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1), or "
                    "set generation.server.router.private_network: false, accepting that every user of this host "
                    "can add a worker to the router and receive the run's token".encode())
        return NO_NAMESPACE_EXIT
    listeners = []
    for host, port in workers:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, port))
        sock.listen(128)
        listeners.append(sock)
    socket.send_fds(ctl, [b"ok"], [sock.fileno() for sock in listeners])
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "VLLM_API_KEY")}  # the router needs neither
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))  # stop the router and wait for it, then exit
    router = subprocess.Popen(router_cmd, env=env)
    while router.poll() is None and not stopping:
        if not select.select([ctl], [], [], 1.0)[0]:
            continue
        message = ctl.recv(64)
        if not message:  # the relay is gone: nobody can reach the router any more
            break
        conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        conn.settimeout(connect_timeout_s)
        try:
            if len(message) != REQUEST_BYTES or not message.isdigit():
                raise OSError(f"not a request: {message[:20]!r}")
            conn.connect((ROUTER_HOST, int(message[:5])))
        except OSError:
            ctl.sendall(answer(False, message))
        else:
            conn.setblocking(True)  # the socket's file is shared with the bridge, which sets its own mode
            socket.send_fds(ctl, [answer(True, message)], [conn.fileno()])
        finally:
            conn.close()
    if router.poll() is None:
        router.terminate()
        try:
            router.wait(15)
        except subprocess.TimeoutExpired:
            router.kill()
    return router.wait() or 0
