import pytest


@pytest.fixture
def local_s3(tmp_path):
    """A local S3 server (SeaweedFS) on 127.0.0.1 for one test, stopped by its recorded PID."""
    from grpo_steps.dev import local_s3

    server = local_s3.start(tmp_path / "s3")
    yield server
    local_s3.stop(server)
