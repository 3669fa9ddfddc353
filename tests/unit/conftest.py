import pytest


@pytest.fixture(scope="module")
def client(s3):
    """A boto3 S3 client of the module's local S3 server (:func:`grpo_steps.weights.chain.make_client`, as the trainer
    and the replicas build theirs), giving up after two attempts so a refused request fails fast."""
    from grpo_steps.weights.chain import make_client

    return make_client(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, max_attempts=2)
