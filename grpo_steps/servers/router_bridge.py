"""vLLM's router where only the run can reach it: ``python -m grpo_steps.servers.router_bridge --host H --port P
--metrics-port M --worker URL [--worker URL ...] -- ROUTER COMMAND`` (``--pod``: in a Kubernetes pod, see below).

vllm-router 0.1.17 serves ``/add_worker``, ``/remove_worker`` and ``/workers`` to whoever reaches it and passes the
client's ``Authorization`` header on to every worker: on a shared host (loopback is not private) anyone who adds a
worker receives the run's token and every rollout. Its ``--api-key`` guards nothing it receives (measured on 0.1.17:
``/add_worker`` answered 200 without a header), and it cannot listen on a unix socket. So this process runs the router
(ROUTER COMMAND, given ``--host`` :data:`ROUTER_HOST` ``--port`` :data:`ROUTER_PORT` and ``--prometheus-port``
:data:`ROUTER_METRICS_PORT`) in a network namespace of its own, whose only interface is its own loopback, and relays
bytes across, reading nothing but the first request head of a client's connection:

- client -> router: a connection to ``H:P`` is relayed when its first request carries the run's token
  (``Authorization: Bearer <GRPO_SERVER_TOKEN>``; any request when the run has no token) and asks for a path under
  ``/v1/`` or one of :data:`TOKEN_PATHS`; an unauthenticated ``GET /health`` is answered by a ``GET /health`` of its
  own to the router (nothing else on that connection is relayed); anything else gets 401 or 403 and is closed.
  Later requests on an admitted connection are not read: only the token's holder opened it.
- router -> worker k: inside the namespace the router reaches worker k at the address its URL names when that is a
  loopback address (the same URL, so the router's metrics name the replicas' own URLs), else at ``127.1.0.<k+1>``
  and the same port; a listener there is relayed to the worker's real address, resolved on this side.
- ``127.0.0.1:M`` -> the router's Prometheus metrics (read-only, no token).

In a Kubernetes pod (``--pod``) the pod's network namespace is already its own: the router listens on the pod's
loopback (:data:`ROUTER_HOST`) and reaches the replicas' Services itself; the bridge listens on the pod's
interface and admits clients as above (the token from the run's Secret).

The namespace needs root (``CLONE_NEWNET``) or unprivileged user namespaces (``CLONE_NEWUSER``); where neither is
allowed the bridge exits with code 3 and says so. Stopping: SIGTERM to this process (or its group: the supervisor's
stop) reaches the namespace's keeper, which stops the router and waits for it; this process exits once the keeper
has. The keeper also stops the router when this process is gone.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import ipaddress
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import urllib.parse

TOKEN_ENV = "GRPO_SERVER_TOKEN"  # as grpo_steps.servers.auth (not imported: this process imports nothing heavy)
ROUTER_HOST = "127.2.0.1"
"""The router's address inside its namespace: a loopback address no worker keeps (:func:`inside_addresses`)."""
ROUTER_PORT = 8000
"""The router's port inside its namespace (the namespace is fresh: every port is free)."""
ROUTER_METRICS_PORT = 9000
"""The router's Prometheus port inside its namespace."""
HEAD_LIMIT_BYTES = 64 * 1024
"""Longest first request head read from a client; a longer one is refused."""
HEAD_TIMEOUT_S = 10.0
"""Seconds a client has to send its first request head (a client that trickles bytes is dropped)."""
OPEN_PATHS = ("/health", "/liveness", "/readiness")
TOKEN_PATHS = ("/inference/v1/generate",)
"""Paths outside ``/v1/`` relayed with the token: vLLM's token-in/token-out sampling route (per-token weight versions,
:data:`grpo_steps.weights.server_flags.TOKEN_GENERATE_PATH`); not its ``/inference/v1/abort_requests``."""
"""Paths answered without the token (``GET`` only; the answer comes from a request of the bridge's own)."""
NO_NAMESPACE_EXIT = 3
"""Exit code when no private network namespace can be made here."""

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


def _keeper(ctl: socket.socket, workers: list[tuple[str, int]], router_cmd: list[str]) -> int:
    """The namespace's keeper (a forked child): make the namespace, hand the relay a listener per worker, start the
    router, then make connections inside the namespace on request (a port, 5 ASCII digits; answer ``ok`` with the
    socket, or ``no``) until the router exits or the relay is gone. Returns the exit code."""
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
        request = ctl.recv(5)
        if not request:  # the relay is gone: nobody can reach the router any more
            break
        conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            conn.connect((ROUTER_HOST, int(request)))
            socket.send_fds(ctl, [b"ok"], [conn.fileno()])
        except OSError:
            ctl.sendall(b"no")
        finally:
            conn.close()
    if router.poll() is None:
        router.terminate()
        try:
            router.wait(15)
        except subprocess.TimeoutExpired:
            router.kill()
    return router.wait() or 0


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes until ``source`` ends, then end ``sink``'s writing side."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass  # either side closed: the other direction ends the relay
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # already closed


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Relay both ways between ``a`` and ``b`` until both directions end, then close both."""
    other = threading.Thread(target=_pump, args=(b, a), daemon=True)
    other.start()
    _pump(a, b)
    other.join()
    a.close()
    b.close()


def _read_head(conn: socket.socket) -> bytes:
    """The first request head (up to and with the blank line), and whatever else arrived with it. Raises ValueError
    past :data:`HEAD_LIMIT_BYTES`, OSError (a timeout) past :data:`HEAD_TIMEOUT_S` seconds."""
    conn.settimeout(HEAD_TIMEOUT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_LIMIT_BYTES:
            raise ValueError("request head too long")
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("closed before a request head")
        data += chunk
    conn.settimeout(None)
    return data


def admit(head: bytes, token_digest: bytes | None) -> str:
    """What the bridge does with a connection whose first request head is ``head``: ``relay``, ``health`` (answer a
    token-less health check), ``401`` or ``403``. ``token_digest``: SHA-256 of the run's token (None: no token).

    >>> digest = hashlib.sha256(b"t").digest()
    >>> admit(b"POST /v1/completions HTTP/1.1\\r\\nAuthorization: Bearer t\\r\\n\\r\\n", digest)
    'relay'
    >>> admit(b"POST /add_worker?url=http://x HTTP/1.1\\r\\nAuthorization: Bearer t\\r\\n\\r\\n", digest)
    '403'
    >>> admit(b"POST /add_worker?url=http://x HTTP/1.1\\r\\n\\r\\n", digest)
    '401'
    >>> admit(b"GET /health HTTP/1.1\\r\\n\\r\\n", digest)
    'health'
    """
    lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    path = rest.partition(" ")[0].split("?", 1)[0]
    authorized = token_digest is None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "authorization":
            scheme, _, given = value.strip().partition(" ")
            authorized = scheme.lower() == "bearer" and secrets.compare_digest(
                hashlib.sha256(given.strip().encode()).digest(), token_digest or b"")
    if authorized:
        allowed = (path.startswith("/v1/") or path in OPEN_PATHS or path in TOKEN_PATHS) and ".." not in path
        return "relay" if allowed else "403"
    return "health" if method == "GET" and path in OPEN_PATHS else "401"


class _Bridge:
    def __init__(self, ctl: socket.socket | None, token: str | None) -> None:
        self.ctl, self.lock = ctl, threading.Lock()
        self.token_digest = hashlib.sha256(token.encode()).digest() if token else None

    def inside(self, port: int) -> socket.socket:
        """A connection to ``port`` inside the router's namespace (``--pod``: this pod's own loopback). Raises OSError
        when the keeper could not make it."""
        if self.ctl is None:
            return socket.create_connection((ROUTER_HOST, port), timeout=10)
        with self.lock:  # one request at a time on the keeper's channel
            self.ctl.sendall(f"{port:05d}".encode())
            message, fds, _, _ = socket.recv_fds(self.ctl, 16, 1)
        if message != b"ok" or not fds:
            raise OSError(f"no connection to port {port} in the router's namespace")
        return socket.socket(fileno=fds[0])

    def client(self, conn: socket.socket) -> None:
        try:
            head = _read_head(conn)
        except (OSError, ValueError):
            conn.close()
            return
        verdict = admit(head, self.token_digest)
        if verdict in ("401", "403"):
            reason = b"the run's token is required" if verdict == "401" else b"only /v1/ and health paths"
            body = b'{"error": "refused by the run\'s router bridge: ' + reason + b'"}'
            status = b"401 Unauthorized" if verdict == "401" else b"403 Forbidden"
            conn.sendall(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            conn.close()
            return
        try:
            upstream = self.inside(ROUTER_PORT)
        except OSError:
            conn.close()
            return
        if verdict == "health":  # a request of our own: nothing the client sent reaches the router
            upstream.sendall(b"GET /health HTTP/1.1\r\nhost: router\r\nconnection: close\r\n\r\n")
            _pump(upstream, conn)
            upstream.close()
            conn.close()
            return
        upstream.sendall(head)
        _relay(conn, upstream)

    def worker(self, conn: socket.socket, target: tuple[str, int]) -> None:
        try:
            upstream = socket.create_connection(target, timeout=10)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        _relay(conn, upstream)

    def metrics(self, conn: socket.socket) -> None:
        try:
            upstream = self.inside(ROUTER_METRICS_PORT)
        except OSError:
            conn.close()
            return
        _relay(conn, upstream)


def _serve(listener: socket.socket, handle, *args) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn, *args), daemon=True).start()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _serve_pod(public: socket.socket, metrics: socket.socket, token: str | None, router_cmd: list[str]) -> int:
    """``--pod``: the router as a child on this pod's loopback, the bridge in front; returns the router's exit code
    (SIGTERM, the pod's stop, is passed on to it)."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "VLLM_API_KEY")}
    router = subprocess.Popen(router_cmd, env=env)
    signal.signal(signal.SIGTERM, lambda *_: router.terminate())
    bridge = _Bridge(None, token)
    threading.Thread(target=_serve, args=(metrics, bridge.metrics), daemon=True).start()
    threading.Thread(target=_serve, args=(public, bridge.client), daemon=True).start()
    print("[router-bridge] vllm-router on this pod's loopback, reached with the run's token", flush=True)
    return router.wait()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description="vllm-router in a private network namespace: ARGS -- ROUTER...")
    parser.add_argument("--host", required=True, help="where clients reach the router")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--worker", action="append", default=[], help="a worker's base URL (repeat)")
    parser.add_argument("--pod", action="store_true",
                        help="a Kubernetes pod: its network namespace is already its own; the router listens on its "
                             "loopback and reaches the workers itself (no namespace, no worker relays)")
    args = parser.parse_args(argv[:split])
    router_cmd = argv[split + 1:]
    if not router_cmd or not (args.worker or args.pod):
        parser.error("give --worker URLs and the router command after --")
    token = os.environ.get(TOKEN_ENV) or None
    public, metrics = _listen(args.host, args.port), _listen(args.metrics_host, args.metrics_port)
    if args.pod:
        sys.exit(_serve_pod(public, metrics, token, router_cmd))
    ours, theirs = socket.socketpair()
    inside = inside_addresses(args.worker)
    pid = os.fork()  # before any thread: unshare(CLONE_NEWUSER) refuses a multithreaded process
    if pid == 0:
        ours.close()
        public.close()
        metrics.close()
        os._exit(_keeper(theirs, inside, router_cmd))
    theirs.close()
    message, fds, _, _ = socket.recv_fds(ours, 4096, len(inside))
    if message != b"ok":
        print(f"[router-bridge] {message.decode(errors='replace')}", file=sys.stderr, flush=True)
        os.waitpid(pid, 0)
        sys.exit(NO_NAMESPACE_EXIT)
    bridge = _Bridge(ours, token)
    for fd, url in zip(fds, args.worker, strict=True):
        parts = urllib.parse.urlsplit(url)
        threading.Thread(target=_serve, args=(socket.socket(fileno=fd), bridge.worker,
                                              (parts.hostname, parts.port or 80)), daemon=True).start()
    threading.Thread(target=_serve, args=(metrics, bridge.metrics), daemon=True).start()
    threading.Thread(target=_serve, args=(public, bridge.client), daemon=True).start()
    # a stop reaches the keeper, which stops the router and waits for it; this process exits when the keeper has
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
    print(f"[router-bridge] vllm-router in a private network namespace, reached at {args.host}:{args.port} with the "
          f"run's token; workers {', '.join(args.worker)}", flush=True)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
