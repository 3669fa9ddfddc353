"""Benchmark: size of a LoRA checkpoint and the time to copy it to a local directory and to upload it to a local
S3 server (SeaweedFS, ``grpo_steps.dev.local_s3``), from a finished flow run's datastore.

    cd WORKDIR_OF_THE_RUN && .venv/bin/python /path/to/bench/lora_checkpoint.py GRPOFlow/RUN_ID

Loads the newest checkpoint of the run's ``train`` task from the local datastore, then prints its files and sizes,
the seconds of ``shutil.copytree`` into a fresh directory (mean of 3) and of a boto3 upload of every file (mean of
3). Not the flow's own save path (metaflow-checkpoint), but the same bytes through the same kind of storage.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    import boto3
    from metaflow import Checkpoint, Flow, namespace

    from grpo_steps.dev import local_s3

    namespace(None)
    flow, run_id = sys.argv[1].split("/")
    task = Flow(flow)[run_id]["train"].task
    newest = max(Checkpoint().list(task=task), key=lambda c: c["metadata"]["global_step"])
    with tempfile.TemporaryDirectory() as scratch:
        ckpt = Path(scratch) / "ckpt"
        Checkpoint().load(newest, str(ckpt))
        files = {str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
        total = sum(files.values())
        print(f"checkpoint step {newest['metadata']['global_step']}: {total / 2**20:.1f} MiB")
        for name, size in sorted(files.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {name}: {size / 2**20:.2f} MiB")
        local = []
        for i in range(3):
            start = time.perf_counter()
            shutil.copytree(ckpt, Path(scratch) / f"copy{i}")
            local.append(time.perf_counter() - start)
        s3 = local_s3.start(Path(scratch) / "s3")
        try:
            client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                                  aws_secret_access_key=s3.secret_key, region_name="us-east-1")
            uploads = []
            for i in range(3):
                start = time.perf_counter()
                for name in files:
                    client.upload_file(str(ckpt / name), s3.bucket, f"bench/{i}/{name}")
                uploads.append(time.perf_counter() - start)
        finally:
            local_s3.stop(s3)
        print(f"local copy: {statistics.fmean(local):.3f} s, S3 upload: {statistics.fmean(uploads):.3f} s (mean of 3)")


if __name__ == "__main__":
    main()
