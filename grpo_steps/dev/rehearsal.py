"""A rendered Argo WorkflowTemplate (``argo-workflows create --only-json``) read as the processes its pods would run:
the entry DAG's tasks in dependency order, and for each task the container (or, for the train step's JobSet, each gang
node's container) as a :class:`PodSpec`: argv, environment, Secrets, volumes and output files, with Argo's
``{{...}}`` parameters filled the way Argo fills them. Pure: nothing here starts a process or reads a file; the
runner (:mod:`grpo_steps.dev.rehearse`) does.

Argo's substitution (https://argo-workflows.readthedocs.io/en/latest/variables/): ``{{name}}`` is a simple tag
(``workflow.name``, ``inputs.parameters.X``, ``tasks.T.outputs.parameters.X``, ``item``, ``retries``), ``{{=expr}}``
an expression (expr-lang with sprig); the expressions Metaflow 2.19 renders are arithmetic on parameters
(``sprig.int(sprig.sub(sprig.int(inputs.parameters['num-parallel']),1))``, ``asInt(inputs.parameters.workerCount)``)
and expr-lang's ``toBase64`` (a conditional join's input paths, ``{{=toBase64(inputs.parameters['input-paths'])}}``,
decoded by Metaflow's ``conditional_input_paths``), which :func:`fill` evaluates; any other function is refused. A
resource template's manifest is filled as text and then parsed, as Argo does. The JobSet controller's part
(``jobset.sigs.k8s.io`` annotations on each pod: job index, JobSet name, restart attempt) and the kubelet's
(``fieldRef`` values) are filled from the pod each spec stands for.
"""

from __future__ import annotations

import ast
import base64
import re
import uuid
from dataclasses import dataclass, field

import yaml

TAG = re.compile(r"\{\{\s*(=?)([^}]*?)\s*\}\}")
HOST_IP = "127.0.0.1"  # every pod of the rehearsal runs on this machine


class RenderError(ValueError):
    """The workflow uses something the rehearsal does not emulate (a template kind, an Argo tag or expression), or a
    parameter has no value yet; the message names it."""


@dataclass(frozen=True)
class Task:
    """One task of the workflow's entry DAG: ``depends`` the tasks that must succeed first, ``arguments`` its
    parameters before filling, ``with_param`` Argo's fan-out expression (a JSON list at run time) or None."""

    name: str
    template: str
    depends: tuple[str, ...]
    arguments: dict[str, str]
    with_param: str | None = None


@dataclass(frozen=True)
class PodSpec:
    """What one pod's container runs, filled: ``argv`` (command + args), ``env`` (literal values and resolved
    ``fieldRef`` values), ``env_from`` (Secret names of ``envFrom``, in order: a later one's keys win, ``env`` wins over
    all), ``secret_keys`` (variable -> (Secret, key) of ``secretKeyRef``), ``mounts`` (mount path -> volume source:
    ``{"emptyDir": ...}`` or ``{"persistentVolumeClaim": ...}``), ``outputs`` (output parameter -> file path the
    container writes), ``workdir`` (the container's ``workingDir``, None: the image's), ``hosts`` (DNS names the pod
    resolves to another pod of the run: the JobSet's control node)."""

    name: str
    template: str
    argv: list[str]
    env: dict[str, str]
    env_from: list[str]
    secret_keys: dict[str, tuple[str, str]] = field(default_factory=dict)
    mounts: dict[str, dict] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    hosts: tuple[str, ...] = ()


def _evaluate(node: ast.AST, values: dict[str, str]) -> str | int:
    """One node of an Argo expression (parsed as Python: the expressions Metaflow renders are valid Python too)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | str):
        return node.value
    if isinstance(node, ast.Subscript | ast.Attribute):
        name = _dotted(node)
        if name not in values:
            raise RenderError(f"no value for {name!r} in an Argo expression")
        return values[name]
    if isinstance(node, ast.Call) and not node.keywords:
        function = _dotted(node.func)
        args = [_evaluate(arg, values) for arg in node.args]
        if function in ("sprig.int", "asInt", "int") and len(args) == 1:
            return int(args[0])
        if function == "sprig.sub" and len(args) == 2:
            return int(args[0]) - int(args[1])
        if function == "sprig.add" and len(args) == 2:
            return int(args[0]) + int(args[1])
        if function == "toBase64" and len(args) == 1:  # expr-lang's builtin: standard base64 of the UTF-8 string
            return base64.b64encode(str(args[0]).encode()).decode()
        raise RenderError(f"the Argo expression function {function}({len(args)} args) is not emulated")
    raise RenderError(f"the Argo expression part {ast.unparse(node)!r} is not emulated")


def _dotted(node: ast.AST) -> str:
    """``inputs.parameters.x`` and ``inputs.parameters['x']`` both as ``inputs.parameters.x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return f"{_dotted(node.value)}.{node.slice.value}"
    raise RenderError(f"the Argo expression part {ast.unparse(node)!r} is not emulated")


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with every Argo tag replaced: ``{{name}}`` by ``values[name]``, ``{{=expr}}`` by the expression's
    value (:func:`_evaluate`).

    Raises:
        RenderError: a tag without a value, or an expression that is not emulated.

    >>> fill("js-{{inputs.parameters.e}}{{retries}}", {"inputs.parameters.e": "ab", "retries": "0"})
    'js-ab0'
    >>> fill("{{=sprig.int(sprig.sub(sprig.int(inputs.parameters['n']),1))}}", {"inputs.parameters.n": "2"})
    '1'
    >>> fill("{{=toBase64(inputs.parameters['p'])}}", {"inputs.parameters.p": "argo-x/register/t-1"})
    'YXJnby14L3JlZ2lzdGVyL3QtMQ=='
    """
    def replace(match: re.Match) -> str:
        expression, name = match.group(1), match.group(2)
        if expression:
            return str(_evaluate(ast.parse(name, mode="eval").body, values))
        if name not in values:
            raise RenderError(f"no value for the Argo tag {{{{{name}}}}} (known: {', '.join(sorted(values))})")
        return values[name]

    return TAG.sub(replace, text)


def _filled(value, values: dict[str, str]):
    """Every string inside a JSON value filled (:func:`fill`)."""
    if isinstance(value, str):
        return fill(value, values)
    if isinstance(value, list):
        return [_filled(v, values) for v in value]
    if isinstance(value, dict):
        return {k: _filled(v, values) for k, v in value.items()}
    return value


def templates(workflow: dict) -> dict[str, dict]:
    """The workflow's templates by name."""
    return {t["name"]: t for t in workflow["spec"]["templates"]}


def dag_tasks(workflow: dict, template: str | None = None) -> list[Task]:
    """The tasks of the DAG template ``template`` (default: the workflow's entrypoint) in an order that runs each after
    the tasks it depends on (``depends: "a.Succeeded && b.Succeeded"`` or ``dependencies: [a, b]``).

    Raises:
        RenderError: the template is not a DAG, or its dependencies form a cycle or name a missing task.
    """
    spec = templates(workflow)[template or workflow["spec"]["entrypoint"]]
    if "dag" not in spec:
        raise RenderError(f"template {spec['name']} is not a DAG")
    tasks = {}
    for task in spec["dag"]["tasks"]:
        depends = tuple(re.findall(r"([\w-]+)\.Succeeded", task.get("depends") or "")) or tuple(
            task.get("dependencies") or ())
        arguments = {p["name"]: p.get("value", "") for p in (task.get("arguments") or {}).get("parameters", [])}
        tasks[task["name"]] = Task(task["name"], task["template"], depends, arguments, task.get("withParam"))
    ordered: list[Task] = []
    while len(ordered) < len(tasks):
        done = {t.name for t in ordered}
        ready = [t for t in tasks.values() if t.name not in done and set(t.depends) <= done]
        if not ready:
            raise RenderError(f"DAG {spec['name']}: no task can run after {sorted(done)} (a cycle or a missing task)")
        ordered.extend(ready)
    return ordered


def task_inputs(task: Task, values: dict[str, str]) -> dict[str, str]:
    """The values the template of ``task`` sees: ``values`` (workflow, tasks' outputs, ``item``, ``retries``) less any
    outer template's inputs, plus ``inputs.parameters.<name>`` for each of the task's arguments, filled from
    ``values``.

    Raises:
        RenderError: an argument's tag without a value.
    """
    outer = {k: v for k, v in values.items() if not k.startswith("inputs.")}
    return {**outer, **{f"inputs.parameters.{k}": fill(v, values) for k, v in task.arguments.items()}}


def _env(container: dict, field_values: dict[str, str]) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    env, secret_keys = {}, {}
    for entry in container.get("env") or []:
        source = entry.get("valueFrom")
        if source is None:
            env[entry["name"]] = "" if entry.get("value") is None else str(entry["value"])
        elif source.get("fieldRef"):
            path = source["fieldRef"]["fieldPath"]
            if path not in field_values:
                raise RenderError(f"{entry['name']}: the fieldRef {path} is not emulated")
            env[entry["name"]] = field_values[path]
        elif source.get("secretKeyRef"):
            ref = source["secretKeyRef"]
            secret_keys[entry["name"]] = (ref["name"], ref["key"])
        else:
            raise RenderError(f"{entry['name']}: valueFrom {source} is not emulated")
    return env, secret_keys


def _pod(name: str, template: str, pod: dict, container: dict, field_values: dict[str, str],
         outputs: dict[str, str] | None = None, hosts: tuple[str, ...] = ()) -> PodSpec:
    env, secret_keys = _env(container, field_values)
    volumes = {v["name"]: {k: v for k, v in v.items() if k != "name"} for v in pod.get("volumes") or []}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts") or []}
    return PodSpec(name, template, [*(container.get("command") or []), *(container.get("args") or [])], env,
                   [e["secretRef"]["name"] for e in container.get("envFrom") or [] if e.get("secretRef")],
                   secret_keys, mounts, outputs or {}, container.get("workingDir"), hosts)


def _fields(namespace: str, pod_name: str, service_account: str | None) -> dict[str, str]:
    """What the kubelet fills into a ``fieldRef`` (the uid a stable function of the name: the spec stays pure)."""
    return {"metadata.namespace": namespace, "metadata.name": pod_name,
            "metadata.uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, pod_name)),
            "spec.serviceAccountName": service_account or "default", "status.hostIP": HOST_IP}


def container_pod(workflow: dict, template: str, values: dict[str, str], pod_name: str) -> PodSpec:
    """The pod of a container template, its tags filled from ``values`` (``workflow.*``, ``inputs.parameters.*``,
    ``retries``), named ``pod_name``.

    Raises:
        RenderError: not a container template, or a tag without a value.
    """
    spec = templates(workflow)[template]
    if "container" not in spec:
        raise RenderError(f"template {template} has no container (kind: {sorted(set(spec) - {'name'})})")
    spec = _filled(spec, values)
    outputs = {p["name"]: p["valueFrom"]["path"] for p in (spec.get("outputs") or {}).get("parameters", [])
               if "path" in p.get("valueFrom", {})}
    fields = _fields(workflow["metadata"]["namespace"], pod_name, spec.get("serviceAccountName"))
    return _pod(pod_name, template, spec, spec["container"], fields, outputs)


def jobset(workflow: dict, template: str, values: dict[str, str]) -> dict:
    """The JobSet a resource template creates, its manifest filled from ``values`` and parsed (YAML or JSON).

    Raises:
        RenderError: not a resource template, or a tag without a value.
    """
    spec = templates(workflow)[template]
    if "resource" not in spec:
        raise RenderError(f"template {template} is not a resource template")
    return yaml.safe_load(fill(spec["resource"]["manifest"], values))


def jobset_pods(workflow: dict, template: str, values: dict[str, str]) -> list[PodSpec]:
    """One :class:`PodSpec` per pod the JobSet controller starts for the resource template ``template``: each
    replicated job's ``replicas`` jobs of one pod each (Metaflow's @parallel: ``control`` x 1, ``worker`` x N-1),
    named as the controller names them (``<jobset>-<job>-<index>-0``), their ``jobset.sigs.k8s.io`` annotations
    filled. ``hosts``: the pod's hostname under the JobSet's subdomain (``<pod>.<subdomain>.<ns>.svc.cluster.local``,
    as ``MF_MASTER_ADDR`` names the control node).

    Raises:
        RenderError: as :func:`jobset`, or a pod that is not one container.
    """
    manifest = jobset(workflow, template, values)
    name = manifest["metadata"]["name"]
    namespace = manifest["metadata"].get("namespace") or workflow["metadata"]["namespace"]
    pods = []
    for job in manifest["spec"]["replicatedJobs"]:
        pod = job["template"]["spec"]["template"]["spec"]
        if len(pod["containers"]) != 1:
            raise RenderError(f"{name}/{job['name']}: {len(pod['containers'])} containers, the rehearsal runs one")
        for index in range(int(job.get("replicas", 1))):
            pod_name = f"{name}-{job['name']}-{index}-0"
            fields = {**_fields(namespace, pod_name, pod.get("serviceAccountName")),
                      "metadata.annotations['jobset.sigs.k8s.io/job-index']": str(index),
                      "metadata.annotations['jobset.sigs.k8s.io/jobset-name']": name,
                      "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']": "0"}
            host = f"{pod_name}.{pod.get('subdomain') or name}.{namespace}.svc.cluster.local"
            pods.append(_pod(pod_name, template, pod, pod["containers"][0], fields, hosts=(host,)))
    return pods


def resolve_env(pod: PodSpec, secrets: dict[str, dict[str, str]], base: dict[str, str]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: ``base`` (the image's ``ENV``), then each ``envFrom``
    Secret's keys in order, then ``env`` (literal, fieldRef and secretKeyRef values) over all of them.

    Raises:
        RenderError: a Secret or a key the pod names does not exist (the pod would stay in CreateContainerConfigError).
    """
    missing = [name for name in pod.env_from if name not in secrets]
    missing += [f"{s}/{k}" for s, k in pod.secret_keys.values() if k not in secrets.get(s, {})]
    if missing:
        raise RenderError(f"pod {pod.name}: the Secret(s) {', '.join(missing)} do not exist (docs/deploy.md step 2)")
    env = dict(base)
    for name in pod.env_from:
        env.update(secrets[name])
    env.update(pod.env)
    env.update({var: secrets[s][k] for var, (s, k) in pod.secret_keys.items()})
    return env
