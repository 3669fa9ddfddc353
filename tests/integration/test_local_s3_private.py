"""``make s3`` (``python -m grpo_steps.dev.local_s3 serve``) is private to the user who started it: fresh keys at
every start in a 0600 file and never printed; another local user (uid 65534 here) can neither read those keys nor
the data directory, nor reach SeaweedFS's master, volume and filer APIs (another network namespace, which it cannot
enter), nor read or write a bucket through S3 with the repository's development pair or anonymously."""

import json
import os
import re
import socket
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
@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
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
        assert [o["Key"] for o in owner.list_objects_v2(Bucket="grpo", Prefix="metaflow/")["Contents"]] == [
            "metaflow/secret.txt"]  # (beside the nonce of serve, .grpo-local-s3/nonce)
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


def _squat(port: int) -> subprocess.Popen:
    """A process of ours that answers every HTTP request on ``127.0.0.1:port`` with 200 and ``x`` (whoever holds the
    port after ``make s3`` is gone)."""
    code = ("import http.server, sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.send_header('content-length', '1'); self.end_headers()\n"
            "        self.wfile.write(b'x')\n"
            "    def log_message(self, *a): pass\n"
            "s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
            "print('up', flush=True)\n"
            "s.serve_forever()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    return proc


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_make_s3_writes_its_env_file_once_ready_and_start_refuses_a_stale_one(tmp_path):
    """The env file of an earlier start is removed before the server starts (a shell waiting for it, as the docs'
    wait line does, never reads old keys), written whole with mode 0600 once S3 answers, and holds a nonce the server
    wrote: ``start``'s check (:func:`grpo_steps.dev.local_s3.check_env`) passes against it, and refuses the same file
    once another process holds the port."""
    import boto3
    from botocore.exceptions import ClientError

    from grpo_steps.config import ConfigError
    from grpo_steps.dev.local_s3 import NONCE_KEY, check_env

    directory, port = tmp_path / ".s3", pick_port("127.0.0.1", 0)
    directory.mkdir(mode=0o700)
    (directory / "env").write_text("export METAFLOW_S3_ENDPOINT_URL=http://127.0.0.1:1\n")  # an earlier start's
    proc = subprocess.Popen([sys.executable, "-m", "grpo_steps.dev.local_s3", "serve", "--dir", str(directory),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stale, deadline = (directory / "env").read_text(), time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if (directory / "env").read_text() != stale:
                    break
            except FileNotFoundError:
                break
            time.sleep(0.02)
        # removed at start, while the server starts (the old serve rewrote it in place once ready: never absent)
        assert not (directory / "env").exists()
        wait = next(line.split("#")[0].strip() for line in (Path(__file__).parents[2] / "docs" / "weight-sync.md")
                    .read_text().splitlines() if line.startswith("until "))
        shell = subprocess.run(["bash", "-c", f"{wait}; source .s3/env; echo $METAFLOW_S3_ENDPOINT_URL"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert shell.stdout.strip() == f"http://127.0.0.1:{port}"  # this start's endpoint, not the earlier one
        assert (directory / "env").stat().st_mode & 0o777 == 0o600
        env = _env(directory)
        check_env(env)  # the server holds the file's nonce
        # the generation servers' read-only pair: it reads the bucket, and writing is refused
        reader = boto3.client("s3", endpoint_url=env["METAFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                              aws_access_key_id=env["GRPO_S3_READONLY_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["GRPO_S3_READONLY_SECRET_ACCESS_KEY"])
        assert reader.get_object(Bucket="grpo", Key=NONCE_KEY)["Body"].read()
        with pytest.raises(ClientError, match="AccessDenied"):
            reader.put_object(Bucket="grpo", Key="weights/forged.json", Body=b"{}")
    finally:
        _stop(proc)
    squatter = _squat(port)
    try:
        with pytest.raises(ConfigError, match=f"the S3 server at http://127.0.0.1:{port} is not the `make s3` that "
                                              "wrote this shell's environment"):
            check_env(env)
    finally:
        squatter.terminate()
        squatter.wait(30)


@pytest.mark.slow  # 13 s on the 2-core box: the server's start, 2000 connections, the stop
def test_the_relay_survives_2000_idle_connections_and_serves_s3_meanwhile(tmp_path):
    """2000 connections that send nothing, against the relay of ``make s3`` limited to 1024 descriptors (a common
    default): the relay closes the oldest idle ones past its cap, and a real S3 client (boto3) is served while all
    2000 are open and after. The old relay (a thread and a gateway connection per connection) stopped accepting for
    good after about 500."""
    import resource

    import boto3
    import psutil
    from botocore.config import Config

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2500:  # the client side of 2000 connections
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    directory = tmp_path / "s3"
    proc, _ = _serve(directory, pick_port("127.0.0.1", 0))
    idle: list = []
    try:
        psutil.Process(proc.pid).rlimit(psutil.RLIMIT_NOFILE, (1024, 1024))  # the relay's process; weed keeps its own
        env = _env(directory)
        host, port = env["METAFLOW_S3_ENDPOINT_URL"].removeprefix("http://").split(":")
        s3 = boto3.client("s3", endpoint_url=env["METAFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          config=Config(connect_timeout=10, read_timeout=30, retries={"max_attempts": 2}))
        for _ in range(2000):
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        for k in range(3):  # while the 2000 are open
            s3.put_object(Bucket="grpo", Key=f"metaflow/k{k}", Body=b"v%d" % k)
            assert s3.get_object(Bucket="grpo", Key=f"metaflow/k{k}")["Body"].read() == b"v%d" % k
    finally:
        for sock in idle:
            sock.close()
    try:
        assert len(idle) == 2000
        assert sorted(o["Key"] for o in s3.list_objects_v2(Bucket="grpo", Prefix="metaflow/")["Contents"]) == [
            "metaflow/k0", "metaflow/k1", "metaflow/k2"]
        assert proc.poll() is None
    finally:
        _stop(proc)
