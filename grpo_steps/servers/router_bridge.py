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
  own to the router (nothing else on that connection is relayed; its answer within the head's deadline, at most
  :data:`MAX_HEALTH` at once); anything else gets 401 or 403 and is closed.
  Later requests on an admitted connection are not read: only the token's holder opened it. A client has
  :data:`HEAD_TIMEOUT_S` in all to send that head, at most :data:`MAX_PENDING` connections wait for theirs (past it
  the oldest is closed), and an admitted connection has no timeout (a slow answer reaches the client whole).
- router -> worker k: inside the namespace the router reaches worker k at the address its URL names when that is a
  loopback address (the same URL, so the router's metrics name the replicas' own URLs), else at ``127.1.0.<k+1>``
  and the same port; a listener there is relayed to the worker's real address, resolved on this side.
- ``127.0.0.1:M`` -> the router's Prometheus metrics (read-only, no token): a ``GET /metrics`` head under the same
  deadline and cap as the clients', at most :data:`MAX_METRICS` relayed at once.

In a Kubernetes pod (``--pod``) the pod's network namespace is already its own: the router listens on the pod's
loopback (:data:`ROUTER_HOST`) and reaches the replicas' Services itself; the bridge listens on the pod's
interface and admits clients as above (the token from the run's Secret).

The namespace needs root (``CLONE_NEWNET``) or unprivileged user namespaces (``CLONE_NEWUSER``); where neither is
allowed the bridge exits with code 3 and says so. The namespace and its keeper are
:mod:`grpo_steps.servers.router_netns`; this module reads and admits the heads and relays the bytes. Stopping: SIGTERM
to this process (or its group: the supervisor's stop) reaches the namespace's keeper, which stops the router and waits
for it; this process exits once the keeper has. The keeper also stops the router when this process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.parse

from grpo_steps.loopback import ForeignListenerError, Pending, check_ours, relay, serve
from grpo_steps.servers.router_netns import (  # the namespace and its keeper; the constants are this module's too
    NO_NAMESPACE_EXIT,
    ROUTER_HOST,
    ROUTER_METRICS_PORT,  # noqa: F401  (re-exported: grpo_steps.servers.router, k8s_manifests)
    ROUTER_PORT,
    TOKEN_ENV,
    channel,
    inside_addresses,
    inside_urls,  # noqa: F401  (re-exported: grpo_steps.servers.router)
    keeper,
    request,
)

HEAD_LIMIT_BYTES = 64 * 1024
"""Longest first request head read from a client; a longer one is refused."""
HEAD_TIMEOUT_S = 10.0
"""Seconds from accepting a client's connection to the end of its first request head, in all (a client that trickles
bytes is dropped at this deadline, however often a byte arrives); ``--head-timeout-s``."""
MAX_PENDING = 256
"""Connections at most that have not yet shown a complete request head (so not the token); past it the oldest of them
is closed (``--max-pending``). Admitted connections are not counted: only the token's holder opens them."""
MAX_METRICS = 8
"""Metrics connections relayed at once at most (no token: the metrics port answers ``GET /metrics`` to anyone); past
it a new one is refused with 503."""
MAX_HEALTH = 8
"""Token-less health checks answered at once at most (each makes a connection to the router); past it 503."""
HEALTH_ANSWER_LIMIT = 1 << 20
"""Bytes of the router's health answer passed on at most (vllm-router's is a few bytes)."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds to connect to the router or a worker; a connection, once made, has no timeout (``--connect-timeout-s``)."""
OPEN_PATHS = ("/health", "/liveness", "/readiness")
TOKEN_PATHS = ("/inference/v1/generate",)
"""Paths outside ``/v1/`` relayed with the token: vLLM's token-in/token-out sampling route (per-token weight versions,
:data:`grpo_steps.weights.server_flags.TOKEN_GENERATE_PATH`); not its ``/inference/v1/abort_requests``."""
"""Paths answered without the token (``GET`` only; the answer comes from a request of the bridge's own)."""
async def _read_head(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """The first request head, up to and with the blank line (what arrived after it stays in ``reader``). Raises
    ValueError past :data:`HEAD_LIMIT_BYTES` or when the client closes first, TimeoutError when the whole head has
    not arrived ``timeout_s`` seconds after the connection was accepted (one deadline on the loop's monotonic clock,
    not one per ``recv``: a client that trickles a byte at a time is dropped at the deadline too)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as err:
        raise ValueError("request head too long") from err
    except asyncio.IncompleteReadError as err:
        raise ValueError("closed before a request head") from err


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
    """The relays of one bridge, on one asyncio event loop (one thread, however many connections).

    Why asyncio's own server and not an HTTP server library (uvicorn/h11, aiohttp): those parse every request of a
    connection and write their own answer, and a proxy built on one would re-encode the router's streamed answers;
    the bridge reads one head, decides, then moves bytes untouched. asyncio (the standard library) gives what the
    HTTP servers use underneath: a total deadline per head (:func:`asyncio.timeout`, monotonic), no thread per
    connection, and an accept loop that survives ``EMFILE``/``ENFILE``/``ENOBUFS``/``ENOMEM`` (it pauses accepting
    for ``asyncio.constants.ACCEPT_RETRY_DELAY`` = 1 s and goes on; other accept errors are logged and the server
    keeps listening: ``BaseSelectorEventLoop._accept_connection``)."""

    def __init__(self, ctl: socket.socket | None, token: str | None, *, head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_pending: int = MAX_PENDING, inside_port: int = ROUTER_PORT,
                 inside_metrics_port: int = ROUTER_METRICS_PORT, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.ctl, self.lock = ctl, asyncio.Lock()
        self.requests = 0  # requests sent to the keeper so far: the next one's id
        self.connect_timeout_s = connect_timeout_s  # also the wait for the keeper's answer (it has half of it)
        self.token_digest = hashlib.sha256(token.encode()).digest() if token else None
        self.head_timeout_s = head_timeout_s
        self.inside_port, self.inside_metrics_port = inside_port, inside_metrics_port
        self.pending = Pending(max_pending)  # connections without a complete head
        self.metrics_open = 0  # metrics connections relayed now
        self.health_open = 0  # token-less health checks being answered now

    async def inside(self, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to ``port`` inside the router's namespace (``--pod``: this pod's own loopback). Raises OSError
        when it cannot be made within ``connect_timeout_s`` (:data:`CONNECT_TIMEOUT_S`). Only the connecting has a
        deadline: the connection itself has none (``create_connection(timeout=10)`` on a relayed socket cut every
        answer slower than 10 s)."""
        if self.ctl is None:
            try:
                return await asyncio.wait_for(asyncio.open_connection(ROUTER_HOST, port), self.connect_timeout_s)
            except TimeoutError as err:
                raise OSError(f"the router did not accept a connection in {self.connect_timeout_s:g} s") from err
        loop = asyncio.get_running_loop()
        async with self.lock:  # one request at a time on the keeper's channel
            self.requests += 1
            sent = request(port, self.requests)
            await loop.sock_sendall(self.ctl, sent)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    while True:
                        message, conn = await self._answer(loop)
                        if message[2:] == sent[5:]:
                            break
                        # an answer to a request already given up on (the keeper was late): dropped, never relayed
                        if conn is not None:
                            conn.close()
            except TimeoutError as err:
                raise OSError("the namespace's keeper did not answer") from err
        if message[:2] != b"ok" or conn is None:
            if conn is not None:
                conn.close()
            raise OSError(f"no connection to port {port} in the router's namespace")
        try:
            peer = conn.getpeername()
        except OSError:
            peer = None
        if peer != (ROUTER_HOST, port):  # the socket relayed must be the one asked for, whatever the channel said
            conn.close()
            raise OSError(f"the keeper relayed a connection to {peer}, not to {ROUTER_HOST}:{port}")
        return await asyncio.open_connection(sock=conn)

    async def _answer(self, loop: asyncio.AbstractEventLoop) -> tuple[bytes, socket.socket | None]:
        """The keeper's next answer and the socket it carries (None: none; every descriptor received beyond the first
        is closed at once)."""
        readable = loop.create_future()
        loop.add_reader(self.ctl, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(self.ctl)
        message, fds, _, _ = socket.recv_fds(self.ctl, 64, 2)
        socks = [socket.socket(fileno=fd) for fd in fds]
        for extra in socks[1:]:
            extra.close()
        if not message:  # the keeper is gone (the channel's end)
            raise OSError("the namespace's keeper is gone")
        return message, (socks[0] if socks else None)

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pending.add(writer)
        try:
            head = await _read_head(reader, self.head_timeout_s)
        except (OSError, ValueError):  # TimeoutError is an OSError
            writer.transport.abort()
            return
        finally:
            self.pending.remove(writer)
        verdict = admit(head, self.token_digest)
        if verdict in ("401", "403"):
            reason = b"the run's token is required" if verdict == "401" else b"only /v1/ and health paths"
            body = b'{"error": "refused by the run\'s router bridge: ' + reason + b'"}'
            status = b"401 Unauthorized" if verdict == "401" else b"403 Forbidden"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            await _close(writer)
            return
        if verdict == "health":
            await self.health(writer)
            return
        try:
            upstream = await self.inside(self.inside_port)
        except OSError:
            writer.transport.abort()
            return
        upstream[1].write(head)  # then whatever the client sent after its head, untouched
        await relay((reader, writer), upstream)

    async def health(self, writer: asyncio.StreamWriter) -> None:
        """A token-less health check, answered by a ``GET /health`` of the bridge's own (nothing the client sent
        reaches the router): the router's answer, at most :data:`HEALTH_ANSWER_LIMIT` bytes, within
        ``head_timeout_s`` (else the client's connection is closed without one); at most :data:`MAX_HEALTH` at once,
        past it 503 (a health check had no bound once its head was read: token-less clients could hold router
        connections without end)."""
        if self.health_open >= MAX_HEALTH:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await _close(writer)
            return
        self.health_open += 1
        upstream = None
        try:
            async with asyncio.timeout(self.head_timeout_s):
                upstream = await self.inside(self.inside_port)
                upstream[1].write(b"GET /health HTTP/1.1\r\nhost: router\r\nconnection: close\r\n\r\n")
                answer = b""
                while len(answer) < HEALTH_ANSWER_LIMIT and (data := await upstream[0].read(65536)):
                    answer += data
            writer.write(answer[:HEALTH_ANSWER_LIMIT])
            await _close(writer)
        except OSError:  # TimeoutError too: no answer in time
            writer.transport.abort()
        finally:
            self.health_open -= 1
            if upstream is not None:
                upstream[1].transport.abort()

    async def worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     target: tuple[str, int]) -> None:
        """The router's connection to a worker, relayed to the worker's real address; a worker on this host's
        loopback must be this user's (the router passes the run's token on): another user's listener on a replica's
        port (the replica gone) gets nothing."""
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(*target), self.connect_timeout_s)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        try:
            check_ours(upstream[1].get_extra_info("socket"), f"worker {target[0]}:{target[1]}")
        except ForeignListenerError as err:
            print(f"[router-bridge] {err}", file=sys.stderr, flush=True)
            upstream[1].transport.abort()
            writer.transport.abort()
            return
        await relay((reader, writer), upstream)

    async def metrics(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """``GET /metrics`` relayed to the router's Prometheus port; its head has the clients' deadline and counts in
        their cap, and at most :data:`MAX_METRICS` are relayed at once (a scraper needs one)."""
        self.pending.add(writer)
        try:
            head = await _read_head(reader, self.head_timeout_s)
        except (OSError, ValueError):
            writer.transport.abort()
            return
        finally:
            self.pending.remove(writer)
        request = head.split(b"\r\n", 1)[0].split(b" ")
        if request[:2] != [b"GET", b"/metrics"] or self.metrics_open >= MAX_METRICS:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                         if request[:2] == [b"GET", b"/metrics"] else
                         b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await _close(writer)
            return
        self.metrics_open += 1
        try:
            upstream = await self.inside(self.inside_metrics_port)
            upstream[1].write(head)
            await relay((reader, writer), upstream)
        except OSError:
            writer.transport.abort()
        finally:
            self.metrics_open -= 1


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    except OSError:
        pass  # the client is gone already
    writer.close()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _serve_pod(public: socket.socket, metrics: socket.socket, bridge: _Bridge, router_cmd: list[str]) -> int:
    """``--pod``: the router as a child on this pod's loopback, the bridge in front; returns the router's exit code
    (SIGTERM, the pod's stop, is passed on to it)."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "VLLM_API_KEY")}
    router = subprocess.Popen(router_cmd, env=env)
    signal.signal(signal.SIGTERM, lambda *_: router.terminate())
    serve([(metrics, bridge.metrics), (public, bridge.client)], "router-bridge", limit=HEAD_LIMIT_BYTES)
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
    parser.add_argument("--head-timeout-s", type=float, default=HEAD_TIMEOUT_S,
                        help="seconds a client has, from its connection, to send its whole first request head")
    parser.add_argument("--max-pending", type=int, default=MAX_PENDING,
                        help="connections without a complete head at most; past it the oldest is closed")
    parser.add_argument("--inside-port", type=int, default=ROUTER_PORT,
                        help="the router's port on the pod's loopback or in its namespace (what ROUTER COMMAND binds)")
    parser.add_argument("--inside-metrics-port", type=int, default=ROUTER_METRICS_PORT)
    parser.add_argument("--connect-timeout-s", type=float, default=CONNECT_TIMEOUT_S,
                        help="seconds to connect to the router or a worker (a connection, once made, has no timeout)")
    args = parser.parse_args(argv[:split])
    router_cmd = argv[split + 1:]
    if not router_cmd or not (args.worker or args.pod):
        parser.error("give --worker URLs and the router command after --")
    token = os.environ.get(TOKEN_ENV) or None
    public, metrics = _listen(args.host, args.port), _listen(args.metrics_host, args.metrics_port)
    limits = {"head_timeout_s": args.head_timeout_s, "max_pending": args.max_pending, "inside_port": args.inside_port,
              "inside_metrics_port": args.inside_metrics_port, "connect_timeout_s": args.connect_timeout_s}
    if args.pod:
        sys.exit(_serve_pod(public, metrics, _Bridge(None, token, **limits), router_cmd))
    ours, theirs = channel()
    inside = inside_addresses(args.worker)
    pid = os.fork()  # before any thread: unshare(CLONE_NEWUSER) refuses a multithreaded process
    if pid == 0:
        ours.close()
        public.close()
        metrics.close()
        # the keeper gives up on a connection in half the bridge's wait for its answer
        os._exit(keeper(theirs, inside, router_cmd, args.connect_timeout_s / 2))
    theirs.close()
    message, fds, _, _ = socket.recv_fds(ours, 4096, len(inside))
    if message != b"ok":
        print(f"[router-bridge] {message.decode(errors='replace')}", file=sys.stderr, flush=True)
        os.waitpid(pid, 0)
        sys.exit(NO_NAMESPACE_EXIT)
    ours.setblocking(False)  # the event loop waits for the keeper's answers
    bridge = _Bridge(ours, token, **limits)
    listeners = [(metrics, bridge.metrics), (public, bridge.client)]
    for fd, url in zip(fds, args.worker, strict=True):
        parts = urllib.parse.urlsplit(url)
        target = (parts.hostname, parts.port or 80)
        listeners.append((socket.socket(fileno=fd),
                          lambda reader, writer, target=target: bridge.worker(reader, writer, target)))
    serve(listeners, "router-bridge", limit=HEAD_LIMIT_BYTES)
    # a stop reaches the keeper, which stops the router and waits for it; this process exits when the keeper has
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
    print(f"[router-bridge] vllm-router in a private network namespace, reached at {args.host}:{args.port} with the "
          f"run's token; workers {', '.join(args.worker)}", flush=True)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
