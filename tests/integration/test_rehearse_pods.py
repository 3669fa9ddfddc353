"""Pods of the rehearsal run as processes (grpo_steps/dev/rehearse_pods.py): each in a mount namespace of its own with
its own /tmp and working directory, the manifest's volumes where it mounts them, the run's pod names resolved to this
machine, and its output parameters read back from the files it wrote, as Argo reads them."""

import os
import subprocess

import psutil
import pytest

from grpo_steps.dev.rehearsal import PodSpec
from grpo_steps.dev.rehearse_pods import PodFailed, outputs_of, run_pods


def _unshare_allowed() -> bool:
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _unshare_allowed(), reason="needs mount namespaces (root; CI runs as root)")
SCRIPT = ("echo t-{n} > /mnt/out/task_id && echo mine > /tmp/own && ls /tmp > seen && "
          "getent hosts js-control-0-0.js.grpo.svc.cluster.local > resolved && df /dev/shm > shm && "
          "echo $MARK > shared/{n} && pwd > cwd && ls -A ~/.cache > cache")


def _pod(n: int) -> PodSpec:
    return PodSpec(f"pod-{n}", "step", ["bash", "-c", SCRIPT.format(n=n)], {"MARK": f"m{n}"}, [],
                   mounts={"/mnt/out": {"emptyDir": {}}, "/dev/shm": {"emptyDir": {"medium": "Memory"}}},
                   outputs={"task-id": "/mnt/out/task_id"}, hosts=("js-control-0-0.js.grpo.svc.cluster.local",) if
                   n == 0 else ())


def test_each_pod_has_its_own_tmp_outputs_and_working_directory(tmp_path):
    pods = [_pod(0), _pod(1)]
    for n in range(2):
        (tmp_path / "pods" / f"pod-{n}" / "work" / "shared").mkdir(parents=True)
    results = run_pods(pods, "step", lambda pod: {"PATH": os.environ["PATH"], **pod.env}, tmp_path, 60)
    assert [r.returncode for r in results] == [0, 0]
    for n, (pod, result) in enumerate(zip(pods, results, strict=True)):
        work = tmp_path / "pods" / pod.name / "work"
        assert outputs_of(pod, result.folders) == {"task-id": f"t-{n}"}
        assert (work / "seen").read_text().split() == ["own"]  # an empty /tmp of its own
        assert (work / "cache").read_text() == ""  # and an empty ~/.cache: no model this machine's user cached
        assert (tmp_path / "pods" / pod.name / "tmp" / "own").read_text() == "mine\n"
        assert (work / "resolved").read_text().startswith("127.0.0.1")  # the control node, as DNS would answer
        assert "tmpfs" in (work / "shm").read_text()  # emptyDir medium Memory
        assert (work / "cwd").read_text().strip() == "/opt/grpo-pipeline"  # the image's WORKDIR, empty
        assert (work / "shared" / str(n)).read_text() == f"m{n}\n"  # its own environment
    assert not os.path.exists("/tmp/own")


def test_a_failing_pod_names_itself_its_exit_and_its_log(tmp_path):
    pod = PodSpec("broken", "step", ["bash", "-c", "echo no such model >&2; exit 3"], {}, [])
    with pytest.raises(PodFailed, match=r"(?s)pod broken \(task step\) exited 3.*no such model"):
        run_pods([pod], "step", lambda pod: {"PATH": os.environ["PATH"]}, tmp_path, 60)


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_a_killed_gang_dies_whole_with_the_processes_under_it(tmp_path):
    """A node lost by the cluster: every pod of the task and each process it started (here a child in a session of
    its own, as a server's supervisor is) killed at once, once the condition holds."""
    pods = [PodSpec(f"node-{n}", "train", ["bash", "-c", "setsid sleep 300 & echo $! > child; touch up; sleep 300"],
                    {}, []) for n in range(2)]
    work = [tmp_path / "pods" / pod.name / "work" for pod in pods]  # each pod's working directory, seen from here
    results = run_pods(pods, "train", lambda pod: {"PATH": os.environ["PATH"]}, tmp_path, 60,
                       kill_when=lambda: all((w / "up").exists() for w in work))
    assert [(r.killed, r.returncode) for r in results] == [(True, -9), (True, -9)]
    for w in work:
        child = int((w / "child").read_text())
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
