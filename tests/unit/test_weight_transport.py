"""One weight transport per ``generation.weight_sync`` behind one protocol, chosen once
(:func:`grpo_steps.training.generation.transport.make_transport`): the config picks it, nothing else branches on the
mode; each has the protocol's four calls; ``close`` leaves nothing of the run behind."""

import pytest

from grpo_steps.config import validate_config
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.disk import AdapterTransport, DiskTransport
from grpo_steps.training.generation.s3 import ChainTransport
from grpo_steps.training.generation.transport import WeightTransport, make_transport

PROTOCOL = ("push", "served_label", "committed", "close")


def _cfg(**generation):
    return validate_config({"generation": generation})


def test_disk_and_adapter_transports_are_chosen_by_the_config_and_close_their_sync_dir(tmp_path):
    client = VLLMClient("http://127.0.0.1:1")
    disk = make_transport(_cfg(weight_sync="disk", sync_dir=str(tmp_path)), client, str(tmp_path / "out"))
    assert type(disk) is DiskTransport and disk.root.is_dir()
    lora = validate_config({"train": {"peft": {"r": 8, "alpha": 16, "push": "adapter"}},
                            "generation": {"sync_dir": str(tmp_path)}})
    adapter = make_transport(lora, client, str(tmp_path / "out"))
    assert type(adapter) is AdapterTransport and adapter.base_model == client.base_model
    for transport in (disk, adapter):
        assert all(callable(getattr(transport, name)) for name in PROTOCOL)
        transport.committed(3)  # a directory has no baseline to advance: a call, not a hasattr
        transport.close()
        assert not transport.root.exists()  # the run's sync directory goes with it


@pytest.mark.s3
def test_s3_needs_the_runs_store_and_nccl_is_no_transport_of_this_protocol(tmp_path, s3, monkeypatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    client = VLLMClient("http://127.0.0.1:1")
    cfg = _cfg(weight_sync="s3")
    with pytest.raises(ValueError, match="needs the run's S3 location"):
        make_transport(cfg, client, str(tmp_path))
    store = {"bucket": s3.bucket, "prefix": "transport-test", "endpoint_url": s3.endpoint}
    chain: WeightTransport = make_transport(cfg, client, str(tmp_path), store)
    assert type(chain) is ChainTransport and chain.chain.anchor_every == cfg.generation.s3_sync.anchor_every
    assert all(callable(getattr(chain, name)) for name in PROTOCOL)
    chain.close()
    nccl = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"weight_sync": "nccl"})})
    with pytest.raises(ValueError, match="'nccl' has no pipeline transport"):
        make_transport(nccl, client, str(tmp_path))
