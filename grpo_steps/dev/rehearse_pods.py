"""Running the pods of a rendered workflow as processes (:mod:`grpo_steps.dev.rehearse` drives it): each pod in a
mount namespace of its own (``unshare --mount``) with its own ``/tmp`` and cache folder, its manifest's volumes bound
where it mounts them (an emptyDir a fresh folder, ``medium: Memory`` a tmpfs, a claim a folder shared by every pod
naming it), an ``/etc/hosts`` resolving the run's pod names to this machine (the cluster's DNS), and its own empty
working directory; the DAG walked as Argo walks it (:func:`grpo_steps.dev.rehearsal.walk`: a task whose ``depends``
or ``when`` is false is Omitted or Skipped, and reported, not run), each task's output parameters read from the files
its container wrote.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from grpo_steps.dev import rehearsal
from grpo_steps.dev.rehearsal import PodSpec
from grpo_steps.processes import ProcessRef, log_tail

IMAGE_WORKDIR = "/opt/grpo-pipeline"  # infra/Dockerfile's WORKDIR: where a container without workingDir starts


class PodFailed(RuntimeError):
    """A pod's container exited non-zero (or ran past its time): the message names the pod, its exit, the head of its
    command and its log's tail."""


class PodsKilled(RuntimeError):
    """The rehearsal killed a task's pods on purpose (``run_dag``'s ``kill``), as a node lost by the cluster kills
    them: ``task`` the task, ``outputs`` the outputs and statuses of the tasks before it (``tasks.*``)."""

    def __init__(self, task: str, outputs: dict[str, str]):
        super().__init__(f"the pods of task {task} were killed")
        self.task, self.outputs = task, outputs


@dataclass(frozen=True)
class PodResult:
    """One pod's run: ``returncode`` of its container (None: stopped after ``timeout_s``), ``seconds`` of wall time,
    ``log`` its stdout and stderr, ``folders`` the host folders of its mounts (mount path -> folder; "" a tmpfs),
    ``killed`` whether the rehearsal killed it (:func:`run_pods`' ``kill_when``)."""

    name: str
    task: str
    returncode: int | None
    seconds: float
    log: Path
    folders: dict[str, str]
    killed: bool = False


def _volume_dir(source: dict, pod_dir: Path, shared: Path, mount_path: str) -> tuple[str, str]:
    """(mount command, host folder) for one volume source."""
    if "persistentVolumeClaim" in source:
        folder = shared / source["persistentVolumeClaim"]["claimName"]
    elif "emptyDir" in source:
        if (source["emptyDir"] or {}).get("medium") == "Memory":
            size = re.sub(r"(\d+)Mi$", r"\1m", (source["emptyDir"] or {}).get("sizeLimit") or "")
            return f"mount -t tmpfs {f'-o size={size} ' if size else ''}tmpfs {shlex.quote(mount_path)}", ""
        folder = pod_dir / "volumes" / mount_path.strip("/").replace("/", "_")
    else:
        raise rehearsal.RenderError(f"volume source {sorted(source)} is not emulated (emptyDir, persistentVolumeClaim)")
    folder.mkdir(parents=True, exist_ok=True)
    return f"mount --bind {shlex.quote(str(folder))} {shlex.quote(mount_path)}", str(folder)


def pod_argv(pod: PodSpec, pod_dir: Path, shared: Path, hosts: list[str],
             image_workdir: str = IMAGE_WORKDIR) -> tuple[list[str], dict[str, str]]:
    """The command that runs ``pod``'s container as its own process, and the host folders of its mounts (mount
    path -> folder; "" a tmpfs). Creates ``pod_dir`` (``work``: the empty working directory, bound at the image's
    ``WORKDIR`` unless the container names one; ``tmp``: its ``/tmp``; ``hosts``: its ``/etc/hosts``) and the mount
    points on this machine. ``/tmp`` is bound last, so a ``pod_dir`` under /tmp works too."""
    work, tmp, home = pod_dir / "work", pod_dir / "tmp", pod_dir / "home"
    for folder in (work, tmp, home):
        folder.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o1777)
    (pod_dir / "hosts").write_text("127.0.0.1 localhost " + " ".join(hosts) + "\n")
    workdir = pod.workdir or image_workdir
    mounts = [f"mount --bind {shlex.quote(str(pod_dir / 'hosts'))} /etc/hosts",
              f"mount --bind {shlex.quote(str(work))} {shlex.quote(workdir)}"]
    folders = {}
    for path in [workdir, *pod.mounts]:
        Path(path).mkdir(parents=True, exist_ok=True)  # the mount point; a pod's container has it from the kubelet
    for path, source in pod.mounts.items():
        command, folders[path] = _volume_dir(source, pod_dir, shared, path)
        mounts.append(command)
    # the user's cache folder empty too (models, vLLM's compilations: not the home, which may hold the interpreter the
    # virtual environment links to), and /tmp: both after the other mounts, whose sources may lie under them
    cache = Path.home() / ".cache"
    cache.mkdir(exist_ok=True)
    script = " && ".join([*mounts, f"mount --bind {shlex.quote(str(home))} {shlex.quote(str(cache))}",
                          f"cd {shlex.quote(workdir)}", f"mount --bind {shlex.quote(str(tmp))} /tmp", 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, pod.name, *pod.argv], folders


def _kill_pod(proc: subprocess.Popen) -> None:
    """SIGKILL to a pod's process and every process under it, at once: what the kubelet's kill of a lost node's pod
    leaves of it (a server supervisor of its own session included). Returns when all are gone."""
    try:
        under = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        under = []
    proc.kill()
    for child in under:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(under, timeout=10)  # gone, not only signalled: the next pods may reuse their ports


def run_pods(pods: list[PodSpec], task: str, env_of, root: Path, timeout_s: float,
             kill_when: Callable[[], bool] | None = None) -> list[PodResult]:
    """Run ``pods`` side by side (a JobSet's gang, or one step's pod) and wait for all; ``env_of(pod)`` gives each its
    environment. A pod that fails stops the others (by the process groups this function started). ``kill_when``:
    asked every second while the pods run; when it answers True every pod is killed (:func:`_kill_pod`), and the
    results say ``killed``.

    Raises:
        PodFailed: a pod exited non-zero or ran past ``timeout_s`` (not when killed).
    """
    hosts = [h for pod in pods for h in pod.hosts]
    started = []
    for pod in pods:
        pod_dir = root / "pods" / pod.name
        argv, folders = pod_argv(pod, pod_dir, root / "claims", hosts)
        log = pod_dir / "log.txt"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env_of(pod), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        started.append((pod, proc, ProcessRef.of(proc.pid), log, folders, time.monotonic()))
    deadline, killed = time.monotonic() + timeout_s, False
    # until every pod exits, one fails (failFast: the others are stopped below), the deadline or the kill
    while any(proc.poll() is None for _, proc, *_ in started) and time.monotonic() < deadline:
        if any(proc.poll() not in (None, 0) for _, proc, *_ in started):
            break
        if kill_when is not None and kill_when():
            for _, proc, *_ in started:
                _kill_pod(proc)
            killed = True
            break
        time.sleep(1)
    results, failed = [], None
    for pod, proc, ref, log, folders, began in started:
        code = proc.wait() if killed else proc.poll()
        if code is None:  # past the deadline, or a partner failed
            ref.stop_group(10)
            proc.wait()
            code = proc.returncode if time.monotonic() < deadline else None
        results.append(PodResult(pod.name, task, code, time.monotonic() - began, log, folders, killed))
        if code != 0 and failed is None and not killed:
            failed = (pod, code, log)
    if failed:
        pod, code, log = failed
        raise PodFailed(f"pod {pod.name} (task {task}) exited {code}; command: {shlex.join(pod.argv)[:300]}...; "
                        f"log {log}:\n{log_tail(log, 40)}")
    return results


def outputs_of(pod: PodSpec, folders: dict[str, str]) -> dict[str, str]:
    """The output parameters a container wrote (``valueFrom.path``, read from the volume that holds the path)."""
    values = {}
    for name, path in pod.outputs.items():
        mount = max((m for m in folders if path.startswith(m.rstrip("/") + "/")), key=len, default=None)
        if mount is None or not folders[mount]:
            raise rehearsal.RenderError(f"{pod.name}: output {name} at {path} is on no volume the pod mounts")
        file = Path(folders[mount]) / path[len(mount.rstrip("/")) + 1:]
        if file.exists():  # Argo fails the step on a missing output; the step's own check comes first below
            values[name] = file.read_text().strip()
    return values


def _json_path(manifest: dict, path: str) -> str:
    """``{.metadata.labels.x}`` (the only JSONPath form Metaflow's resource outputs use) from ``manifest``."""
    value = manifest
    for part in path.strip("{}").strip(".").split("."):
        value = value[part]
    return str(value)


def run_dag(workflow: dict, template: str | None, values: dict[str, str], env_of, root: Path, timeout_s: float,
            report, kill: tuple[str, Callable[[], bool]] | None = None) -> dict[str, str]:
    """Run the DAG ``template`` (None: the entrypoint) as Argo would, pod by pod (:func:`grpo_steps.dev.rehearsal.walk`:
    a task whose ``depends`` or ``when`` is false does not run); ``report(PodResult)`` after each pod,
    ``report(NotRun)`` for each task that does not run. Returns the tasks' outputs and statuses
    (``tasks.<task>.outputs.parameters.<name>``, ``tasks.<task>.status``). ``kill``: (task, condition): that task's
    pods are killed once the condition holds (:func:`run_pods`), and the run ends there.

    Raises:
        PodFailed: the first pod that failed (the DAG's failFast: nothing after it runs).
        PodsKilled: ``kill``'s task was killed.
        RenderError: a template, tag or expression the rehearsal does not emulate.
    """
    def run(task: rehearsal.Task, inputs: dict[str, str], item) -> dict[str, str]:
        spec = rehearsal.templates(workflow)[task.template]
        if "resource" in spec:
            pods = rehearsal.jobset_pods(workflow, task.template, inputs)
            kill_when = kill[1] if kill and kill[0] == task.name else None
            results = run_pods(pods, task.name, env_of, root, timeout_s, kill_when)
            for result in results:
                report(result)
            if any(r.killed for r in results):
                raise PodsKilled(task.name, {k: v for k, v in inputs.items() if k.startswith("tasks.")})
            manifest = rehearsal.jobset(workflow, task.template, inputs)
            return {p["name"]: _json_path(manifest, p["valueFrom"]["jsonPath"])
                    for p in (spec.get("outputs") or {}).get("parameters", [])}
        name = f"{values['workflow.name']}-{task.name}" + ("" if item is None else f"-{item}")
        pod = rehearsal.container_pod(workflow, task.template, inputs, name)
        (result,) = run_pods([pod], task.name, env_of, root, timeout_s)
        report(result)
        return outputs_of(pod, result.folders)

    return rehearsal.walk(workflow, template, values, run, report)
