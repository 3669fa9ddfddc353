import os

import pytest

os.environ.setdefault("METAFLOW_USER", "grpo-tests")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """A tiny Qwen2 policy with a locally trained tokenizer, built once (cached) in ~20 s."""
    from grpo_steps.models import TINY, prepare_embedded

    return str(prepare_embedded(TINY))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
