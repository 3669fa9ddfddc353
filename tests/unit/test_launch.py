"""The ``accelerate launch`` command line of one node and the gang's rendezvous port."""

import time

import pytest

from grpo_steps.launch import accelerate_command, rendezvous_port

COMMANDS = [
    # (deepspeed config, flags that must be there, flags that must not)
    # plain DDP, on GPUs or CPU: torch.distributed.run (accelerate's --cpu would start one process per node)
    (None, ["--multi_gpu"], ["--use_deepspeed", "--cpu"]),
    ("ds.json", ["--use_deepspeed", "--deepspeed_multinode_launcher"], ["--cpu", "--multi_gpu"]),
]


@pytest.mark.parametrize(("ds", "present", "absent"), COMMANDS)
def test_accelerate_command_flags(ds, present, absent):
    cmd = accelerate_command("job.json", num_nodes=2, processes_per_node=4, node_index=1, main_ip="10.0.0.5",
                             main_port=29999, deepspeed_config=ds)
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert (flags["--num_machines"], flags["--machine_rank"], flags["--num_processes"]) == ("2", "1", "8")
    assert (flags["--main_process_ip"], flags["--main_process_port"]) == ("10.0.0.5", "29999")
    assert all(f in cmd for f in present) and not any(f in cmd for f in absent)
    assert cmd[-3:] == ["--module", "grpo_steps.training", "job.json"]


def test_one_plain_process_runs_the_training_module_without_a_launcher():
    cmd = accelerate_command("job.json", num_nodes=1, processes_per_node=1, node_index=0, main_ip="127.0.0.1",
                             main_port=29500, deepspeed_config=None)
    assert cmd[1:] == ["-m", "grpo_steps.training", "job.json"]
    with_deepspeed = accelerate_command("job.json", num_nodes=1, processes_per_node=1, node_index=0,
                                        main_ip="127.0.0.1", main_port=29500, deepspeed_config="ds.json")
    assert "accelerate.commands.launch" in with_deepspeed and "--use_deepspeed" in with_deepspeed


def test_rendezvous_port_is_shared_by_a_gang_and_differs_between_runs():
    ports = {rendezvous_port(0, f"run-{i}") for i in range(50)}
    assert rendezvous_port(0, "run-7") == rendezvous_port(0, "run-7")  # every node computes the same
    assert len(ports) > 45 and all(29500 <= p < 49500 for p in ports)
    assert rendezvous_port(31000, "run-7") == 31000  # train.main_process_port wins


def test_a_training_process_killed_from_outside_is_reported_as_likely_out_of_memory_with_its_peak(tmp_path):
    """A real child that holds ~200 MiB, then is SIGKILLed from outside as the OOM killer would: the exit code says
    signal 9, the sampled peak covers what it held, and the message names both and what to change."""
    import os
    import signal
    import sys
    import threading

    from grpo_steps.launch import failure_message
    from grpo_steps.processes import run_watching_memory, wait_until

    ready = tmp_path / "pid"
    child = ("import os, time\n"
             "data = b'x' * (200 * 2**20)\n"  # filled bytes: resident, not lazily mapped zero pages
             f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
             "time.sleep(60)\n")

    def kill_when_held() -> None:
        assert wait_until(lambda: ready.exists() and ready.read_text(), timeout_s=60, interval_s=0.05)
        time.sleep(1.5)  # a few of the sampler's 0.5 s samples see the memory held
        os.kill(int(ready.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_held)
    killer.start()
    code, peak = run_watching_memory([sys.executable, "-c", child])
    killer.join()
    assert code == -signal.SIGKILL
    assert peak >= 200 * 2**20
    message = failure_message(0, code, peak)
    assert message.startswith("training process on node 0 was killed (signal 9), likely out of memory: peak resident "
                              f"memory {peak / 2**30:.2f} GiB")
    assert "resources.train.memory_mib" in message and "newest complete checkpoint" in message
    assert failure_message(1, 137, peak).startswith("training process on node 1 was killed (signal 9)")
    assert "killed by signal 15 (SIGTERM)" in failure_message(0, -15, peak)
