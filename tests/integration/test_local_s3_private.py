"""``make s3`` (``python -m grpo_steps.dev.local_s3 serve``) is private to the user who started it: fresh keys at
every start in a 0600 file and never printed; another local user (uid 65534 here) can neither read those keys nor
the data directory, nor reach SeaweedFS's master, volume and filer APIs (another network namespace, which it cannot
enter), nor read or write a bucket through S3 with the repository's development pair or anonymously."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_steps.processes import pick_port

pytestmark = pytest.mark.s3
OTHER_UID = 65534  # nobody


def _serve(directory: Path, port: int) -> tuple[subprocess.Popen, str]:
    """Start ``serve`` and wait for its ready lines; returns (process, its output so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo_steps.dev.local_s3", "serve", "--dir", str(directory),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = ""
    deadline = time.monotonic() + 120
    while "tracking.artifact_location" not in out and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        out += line
    assert "tracking.artifact_location" in out, out
    return proc, out


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # its SIGTERM handler stops weed by the PID it started
    proc.wait(timeout=60)


def _env(directory: Path) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(.*)$", (directory / "env").read_text(), re.MULTILINE))


OTHER_USER = r'''
import ctypes, json, os, socket, sys
import boto3
from botocore.exceptions import ClientError, NoCredentialsError
directory, endpoint, weed_pid, uid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
clients = {label: boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds) for label, creds in [
    ("dev pair", {"aws_access_key_id": "grpo-dev-key", "aws_secret_access_key": "grpo-dev-secret"}),
    ("guessed", {"aws_access_key_id": "grpo-0", "aws_secret_access_key": "x"})]}
import encodings.idna  # noqa: F401 - loaded lazily by the first connection: load it while the files are readable
for s3 in clients.values():  # a first (refused) call loads what botocore loads lazily
    try:
        s3.list_objects_v2(Bucket="grpo")
    except ClientError:
        pass
# from here on another user: the interpreter and botocore's models were loaded from a checkout it cannot read
os.setgroups([]); os.setgid(uid); os.setuid(uid)
assert os.getuid() == uid and os.geteuid() == uid
seen = {}
for name, path in [("env", f"{directory}/env"), ("s3.json", f"{directory}/s3.json")]:
    try:
        open(path).read(); seen[name] = "read"
    except PermissionError:
        seen[name] = "denied"
try:
    os.listdir(f"{directory}/data"); seen["data"] = "listed"
except PermissionError:
    seen["data"] = "denied"
try:  # the filer's own unix socket
    socket.socket(socket.AF_UNIX).connect(f"{directory}/sockets/filer.sock"); seen["filer.sock"] = "connected"
except PermissionError:
    seen["filer.sock"] = "denied"
try:  # the namespace where master, volume and filer listen (setns(2): os.setns is Python 3.12's)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{weed_pid}/ns/net", os.O_RDONLY)
    seen["netns"] = "entered" if libc.setns(fd, 0x40000000) == 0 else "denied"  # CLONE_NEWNET
except PermissionError:
    seen["netns"] = "denied"
for label, s3 in clients.items():
    for op, call in [("write", lambda: s3.put_object(Bucket="grpo", Key="metaflow/evil", Body=b"x")),
                     ("read", lambda: s3.get_object(Bucket="grpo", Key="metaflow/secret.txt")),
                     ("list", lambda: s3.list_objects_v2(Bucket="grpo"))]:
        try:
            call(); seen[f"{label} {op}"] = "allowed"
        except ClientError as err:
            seen[f"{label} {op}"] = err.response["Error"]["Code"]
print(json.dumps(seen))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_make_s3_is_private_to_its_user(tmp_path):
    import boto3
    import psutil

    directory = tmp_path / "s3"
    proc, out = _serve(directory, pick_port("127.0.0.1", 0))
    try:
        env = _env(directory)
        endpoint, key, secret = env["METAFLOW_S3_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        assert secret not in out and key not in out  # never printed
        assert (directory / "env").stat().st_mode & 0o777 == 0o600
        assert directory.stat().st_mode & 0o777 == 0o700
        assert key != "grpo-dev-key" and len(secret) >= 32
        owner = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                             region_name="us-east-1")
        owner.put_object(Bucket="grpo", Key="metaflow/secret.txt", Body=b"the flow's artifact")
        (weed,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "weed"]
        assert os.readlink(f"/proc/{weed.pid}/ns/net") != os.readlink("/proc/self/ns/net")  # its own namespace
        tmp_path.chmod(0o755)  # the other user may walk to the directory; what is inside decides
        other = subprocess.run([sys.executable, "-c", OTHER_USER, str(directory), endpoint, str(weed.pid),
                                str(OTHER_UID)], capture_output=True, text=True, timeout=120,
                               env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"}, cwd="/")
        assert other.returncode == 0, other.stderr[-3000:]
        seen = json.loads(other.stdout.strip().splitlines()[-1])
        assert {k: seen[k] for k in ("env", "s3.json", "data", "filer.sock", "netns")} == dict.fromkeys(
            ("env", "s3.json", "data", "filer.sock", "netns"), "denied"), seen
        assert not [k for k, v in seen.items() if v == "allowed"], seen  # no S3 read, write or list
        assert owner.get_object(Bucket="grpo", Key="metaflow/secret.txt")["Body"].read() == b"the flow's artifact"
        assert [o["Key"] for o in owner.list_objects_v2(Bucket="grpo")["Contents"]] == ["metaflow/secret.txt"]
    finally:
        _stop(proc)
    # a second start: fresh keys; the first ones open nothing
    proc, _ = _serve(directory, pick_port("127.0.0.1", 0))
    try:
        again = _env(directory)
        assert again["AWS_SECRET_ACCESS_KEY"] != secret and again["AWS_ACCESS_KEY_ID"] != key
        stale = boto3.client("s3", endpoint_url=again["METAFLOW_S3_ENDPOINT_URL"], aws_access_key_id=key,
                             aws_secret_access_key=secret, region_name="us-east-1")
        from botocore.exceptions import ClientError

        with pytest.raises(ClientError):
            stale.list_objects_v2(Bucket="grpo")
    finally:
        _stop(proc)
