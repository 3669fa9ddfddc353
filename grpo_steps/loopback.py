"""Loopback is not private on a shared host: what the pipeline's relays and clients share about it. Standard library
only (the router bridge's process imports nothing heavy).

- :func:`check_ours`: before the run's token goes to a port on this host, the listener there must be this user's (or
  root's). A
  connection's other end is a socket of whoever listens; the kernel lists it in ``/proc/net/tcp`` (``tcp6``) with its
  owner's uid, which an accepted socket takes from its listener (``sk_uid``, copied at the handshake, also while the
  connection waits in the accept queue). The same question systemd's socket activation asks before it trusts a
  listener (``SO_PEERCRED`` answers it for unix sockets only).
- :func:`relay`, :class:`Pending`, :func:`serve`: byte relays on one asyncio event loop in a thread (the router
  bridge, the dev S3 relay): no thread per connection, a cap on connections that have not shown their first bytes
  (past it the oldest is closed), and asyncio's accept loop, which survives running out of descriptors (``EMFILE``,
  ``ENFILE``, ``ENOBUFS``, ``ENOMEM``: it pauses accepting for ``asyncio.constants.ACCEPT_RETRY_DELAY`` = 1 s and goes
  on; ``BaseSelectorEventLoop._accept_connection``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ForeignListenerError(ConnectionError):
    """The listener on a loopback port belongs to another user (or cannot be told): nothing is sent to it."""


def _proc_address(host: str, port: int) -> str:
    """``host:port`` as ``/proc/net/tcp{,6}`` writes it: each 32-bit word of the address in host byte order, in hex.

    >>> _proc_address("127.0.0.1", 8000) if sys.byteorder == "little" else "0100007F:1F40"
    '0100007F:1F40'
    """
    packed = socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of the connected TCP socket ``sock`` on this host (the listener's owner), from
    the row of ``/proc/net/tcp`` (or ``tcp6``) whose local address is ``sock``'s peer and whose remote address is
    ``sock``; None when no such row is listed (the connection is already gone)."""
    me, peer = sock.getsockname()[:2], sock.getpeername()[:2]
    wanted = (_proc_address(*peer), _proc_address(*me))
    table = "tcp6" if sock.family == socket.AF_INET6 else "tcp"
    for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
        fields = row.split()
        if (fields[1], fields[2]) == wanted:
            return int(fields[7])
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this host's loopback.

    >>> [is_loopback(h) for h in ("127.0.0.1", "127.1.0.2", "::1", "localhost", "10.0.0.5", "vllm.svc")]
    [True, True, True, True, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_ours(sock: socket.socket, what: str) -> None:
    """Raise :class:`ForeignListenerError` when ``sock`` is connected to a loopback port whose listener is neither
    this user's nor root's (a port another user bound after ours was gone, or before we came); other peers pass (the
    network's own security: TLS, the cluster). ``what``: the server's name in the message."""
    peer = sock.getpeername()[0]
    if not is_loopback(peer):
        return
    owner = peer_uid(sock)
    if owner not in (os.getuid(), 0):  # root reads this user's memory anyway (and runs docker-proxy's ports)
        raise ForeignListenerError(
            f"{what} at {peer}:{sock.getpeername()[1]} is served by "
            f"{'a listener the kernel no longer lists' if owner is None else f'uid {owner}'}, not by this user "
            f"(uid {os.getuid()}): the run's token is not sent there. Another user holds the port (the run's own "
            "server is gone): stop and restart the run's server")


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until ``reader`` ends, then end ``writer``'s writing side. No timeout: an admitted connection may
    wait as long as its server takes to answer (a group of long completions behind others takes minutes)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass  # either side closed (RuntimeError: write_eof on a closing transport): the other direction ends it


async def relay(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    """Relay both ways between ``a`` and ``b`` until both directions end, then close both."""
    try:
        await asyncio.gather(pump(a[0], b[1]), pump(b[0], a[1]))
    finally:
        a[1].close()
        b[1].close()


class Pending:
    """Connections that have not yet shown their first bytes (a request head), at most ``cap``: past it the oldest is
    closed (a client of the run sends at once: the longest waiter is the likeliest to stall)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.writers: dict[int, asyncio.StreamWriter] = {}  # oldest first

    def add(self, writer: asyncio.StreamWriter) -> None:
        while len(self.writers) >= self.cap:
            self.writers.pop(next(iter(self.writers))).transport.abort()
        self.writers[id(writer)] = writer

    def remove(self, writer: asyncio.StreamWriter) -> None:
        self.writers.pop(id(writer), None)


def serve(listeners: list[tuple[socket.socket, Handler]], name: str, *, limit: int = 65536) -> threading.Thread:
    """Serve each ``(listening socket, handler)`` on one asyncio event loop in a daemon thread named ``name`` (the
    caller's thread goes on); returns once they listen. ``limit``: the stream readers' buffer limit (bytes)."""
    ready = threading.Event()

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(_log_once_in_a_while(name))
        for sock, handle in listeners:
            await asyncio.start_server(handle, sock=sock, limit=limit)
        ready.set()
        await asyncio.Event().wait()  # for as long as the process lives

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True, name=name)
    thread.start()
    ready.wait(30)
    return thread


def _log_once_in_a_while(name: str) -> Callable[[asyncio.AbstractEventLoop, dict], None]:
    """The event loop's errors, one line per kind every 10 s at most: out of descriptors, asyncio retries ``accept()``
    up to 100 times a second and would write a traceback each time (a full stderr pipe would then stall the loop)."""
    last_logged: dict[str, float] = {}

    def log(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = context.get("message", "event loop error")
        now = time.monotonic()
        if now - last_logged.get(message, -10.0) >= 10.0:
            last_logged[message] = now
            print(f"[{name}] {message}: {context.get('exception')!r} (going on)", file=sys.stderr, flush=True)

    return log
