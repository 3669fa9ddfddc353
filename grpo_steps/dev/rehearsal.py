"""A rendered Argo WorkflowTemplate (``argo-workflows create --only-json``) read as the processes its pods would run:
the entry DAG walked as Argo's controller walks it (:func:`walk`: which tasks run, in what order, with which inputs),
and for each task the container (or, for the train step's JobSet, each gang node's container) as a :class:`PodSpec`:
argv, environment, Secrets, volumes and output files, with Argo's ``{{...}}`` parameters filled the way Argo fills
them. Pure: nothing here starts a process or reads a file; the runner (:mod:`grpo_steps.dev.rehearse_pods`) does.

Argo's substitution (https://argo-workflows.readthedocs.io/en/latest/variables/): ``{{name}}`` is a simple tag
(``workflow.name``, ``inputs.parameters.X``, ``tasks.T.outputs.parameters.X``, ``tasks.T.status``, ``item``,
``retries``), ``{{=expr}}`` an expression (expr-lang with sprig); the expressions Metaflow 2.19 renders are arithmetic
on parameters (``sprig.int(sprig.sub(sprig.int(inputs.parameters['num-parallel']),1))``,
``asInt(inputs.parameters.workerCount)``), expr-lang's ``toBase64`` (a conditional join's input paths,
``{{=toBase64(inputs.parameters['input-paths'])}}``, decoded by Metaflow's ``conditional_input_paths``) and a switch's
route (``tasks['prepare-data'].status == 'Succeeded' ? ... : nil) == 'end'``), which :func:`fill` evaluates
(:mod:`grpo_steps.dev.argo_expressions`); anything else is refused. The flow's switch after ``prepare_data`` is
rendered as Argo conditions: ``when`` on the first task of each route and on the join ``end``, whose ``depends`` is
``prepare-data.Succeeded || register.Succeeded``; :func:`walk` skips and omits tasks as Argo does. A resource
template's manifest is filled as text and then parsed, as Argo does. The JobSet controller's part
(``jobset.sigs.k8s.io`` annotations on each pod: job index, JobSet name, restart attempt) and the kubelet's
(``fieldRef`` values) are filled from the pod each spec stands for.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from grpo_steps.dev.argo_expressions import RenderError, depends_holds, depends_tasks, expression_value, when_holds

TAG = re.compile(r"\{\{\s*(=?)([^}]*?)\s*\}\}")
HOST_IP = "127.0.0.1"  # every pod of the rehearsal runs on this machine


@dataclass(frozen=True)
class Task:
    """One task of a DAG: ``depends`` the tasks that must complete first, ``arguments`` its parameters before
    filling, ``with_param`` Argo's fan-out expression (a JSON list at run time) or None, ``depends_logic`` its
    ``depends`` expression (``dependencies: [a, b]`` as ``a && b``, Argo's reading) and ``when`` its condition, as
    rendered (None: none)."""

    name: str
    template: str
    depends: tuple[str, ...]
    arguments: dict[str, str]
    with_param: str | None = None
    depends_logic: str | None = None
    when: str | None = None


@dataclass(frozen=True)
class NotRun:
    """A task Argo does not run (:func:`walk`): ``status`` Omitted (its ``depends`` is false) or Skipped (its
    ``when`` is false, or its ``withParam`` an empty list); ``reason`` says which, as Argo's node message does (the
    ``when`` with its tags filled)."""

    task: str
    status: str
    reason: str


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


def fill(text: str, values: dict[str, str], unresolved: tuple[str, ...] = ()) -> str:
    """``text`` with every Argo tag replaced: ``{{name}}`` by ``values[name]``, ``{{=expr}}`` by the expression's
    value (:func:`grpo_steps.dev.argo_expressions.expression_value`). A ``{{tasks.<t>....}}`` tag of a task ``t`` in
    ``unresolved`` (one that did not run) and without a value stays as written, as Argo v4.0.0 leaves it
    (``template.Replace`` with allowUnresolved; Metaflow's ``conditional_input_paths`` drops such paths: :func:`walk`).

    Raises:
        RenderError: a tag without a value, or an expression that is not emulated.

    >>> fill("js-{{inputs.parameters.e}}{{retries}}", {"inputs.parameters.e": "ab", "retries": "0"})
    'js-ab0'
    >>> fill("{{=sprig.int(sprig.sub(sprig.int(inputs.parameters['n']),1))}}", {"inputs.parameters.n": "2"})
    '1'
    >>> fill("{{=toBase64(inputs.parameters['p'])}}", {"inputs.parameters.p": "argo-x/register/t-1"})
    'YXJnby14L3JlZ2lzdGVyL3QtMQ=='
    >>> fill("p/{{tasks.p.outputs.parameters.id}},r/{{tasks.r.outputs.parameters.id}}",
    ...      {"tasks.p.outputs.parameters.id": "t-1"}, unresolved=("r",))
    'p/t-1,r/{{tasks.r.outputs.parameters.id}}'
    """
    kept = tuple(f"tasks.{task}." for task in unresolved)

    def replace(match: re.Match) -> str:
        expression, name = match.group(1), match.group(2)
        if expression:
            return expression_value(name, values)
        if name not in values and kept and name.startswith(kept):
            return match.group(0)
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
    the tasks its ``depends`` names (any expression: ``a.Succeeded || b``) or its ``dependencies: [a, b]``.

    Raises:
        RenderError: the template is not a DAG, or its dependencies form a cycle or name a missing task.
    """
    spec = templates(workflow)[template or workflow["spec"]["entrypoint"]]
    if "dag" not in spec:
        raise RenderError(f"template {spec['name']} is not a DAG")
    tasks = {}
    for task in spec["dag"]["tasks"]:
        logic = task.get("depends") or " && ".join(task.get("dependencies") or ()) or None
        arguments = {p["name"]: p.get("value", "") for p in (task.get("arguments") or {}).get("parameters", [])}
        tasks[task["name"]] = Task(task["name"], task["template"], depends_tasks(logic or ""), arguments,
                                   task.get("withParam"), logic, task.get("when") or None)
    ordered: list[Task] = []
    while len(ordered) < len(tasks):
        done = {t.name for t in ordered}
        ready = [t for t in tasks.values() if t.name not in done and set(t.depends) <= done]
        if not ready:
            raise RenderError(f"DAG {spec['name']}: no task can run after {sorted(done)} (a cycle or a missing task)")
        ordered.extend(ready)
    return ordered


def task_inputs(task: Task, values: dict[str, str], unresolved: tuple[str, ...] = ()) -> dict[str, str]:
    """The values the template of ``task`` sees: ``values`` (workflow, tasks' outputs, ``item``, ``retries``) less any
    outer template's inputs, plus ``inputs.parameters.<name>`` for each of the task's arguments, filled from
    ``values`` (the tags of the tasks ``unresolved`` may stay as written: :func:`fill`).

    Raises:
        RenderError: an argument's tag without a value.
    """
    outer = {k: v for k, v in values.items() if not k.startswith("inputs.")}
    return {**outer, **{f"inputs.parameters.{k}": fill(v, values, unresolved) for k, v in task.arguments.items()}}


STRICT_TAGS_FROM = ((3, 7, 11), (4, 0, 2))
"""The Argo patch releases from which a ``tasks.*`` tag must resolve (``template.ReplaceStrict``): on 3.7 from 3.7.11,
and from 4.0.2 on. A task whose arguments name a task that did not run is requeued, never started (later: failed as an
absent optional); Metaflow's conditional join names every branch (Netflix/metaflow#3043, fix proposed in
Netflix/metaflow#3344)."""
STRICT_TAGS_TEXT = " and ".join(f"v{'.'.join(map(str, v))}" for v in STRICT_TAGS_FROM)


def resolves_tags_strictly(version: tuple[int, int, int]) -> bool:
    """Whether Argo ``version`` (major, minor, patch) is one of :data:`STRICT_TAGS_FROM`'s releases.

    >>> [resolves_tags_strictly(v) for v in ((3, 7, 10), (3, 7, 11), (4, 0, 1), (4, 0, 2), (4, 1, 0))]
    [False, True, False, True, True]
    """
    on_37, from_40 = STRICT_TAGS_FROM
    return on_37 <= version < (4, 0, 0) or version >= from_40


def walk(workflow: dict, template: str | None, values: dict[str, str],
         run: Callable[[Task, dict[str, str], object], dict[str, str]],
         not_run: Callable[[NotRun], None], strict_tags: bool = False) -> dict[str, str]:
    """The DAG ``template`` (None: the entrypoint) walked as Argo's controller walks it (``executeDAGTask``,
    argoproj/argo-workflows v4.0 workflow/controller/dag.go), each task in :func:`dag_tasks`' order, once every task
    it depends on is done: Omitted when its ``depends`` is false (:func:`depends_holds`); else Skipped when its
    ``when``, filled with the values known (``values``, the outputs and ``tasks.<t>.status`` of the tasks before it),
    is false (:func:`when_holds`), or its ``withParam`` is an empty list; else run once per item: a DAG template by
    this walk, any other by ``run(task, inputs, item)`` (:func:`task_inputs`; item None without ``withParam``), which
    returns its output parameters (name -> value), and then Succeeded. ``not_run`` hears of each task that is not.
    A task's arguments keep the tags of the tasks that did not run as written (:func:`fill`), as Argo v3.6 to v4.0.1
    do and Metaflow 2.19's conditional join expects. ``strict_tags``: as the later patch releases
    (:data:`STRICT_TAGS_FROM`) resolve ``tasks.*`` tags, where such a task never starts.

    Returns:
        The tasks' outputs and statuses: ``tasks.<task>.outputs.parameters.<name>`` and ``tasks.<task>.status``.

    Raises:
        RenderError: a template, tag or expression the rehearsal does not emulate; with ``strict_tags``, a task whose
            arguments name a task that did not run (the task named, and the Argo releases that would hang on it); or
            what ``run`` raises.
    """
    outputs: dict[str, str] = {}
    statuses: dict[str, str] = {}
    fan_outs: dict[str, list[str]] = {}
    for task in dag_tasks(workflow, template):
        known, status, items = {**values, **outputs}, None, [None]
        # the reasons in Argo's words (a node's message)
        if task.depends_logic and not depends_holds(task.depends_logic, statuses, fan_outs):
            status, reason = "Omitted", f"depends '{task.depends_logic}' not met"
        elif task.when and not when_holds(when := fill(task.when, known)):
            status, reason = "Skipped", f"when '{when}' evaluated false"
        elif task.with_param and not (items := json.loads(fill(task.with_param, known))):
            status, reason = "Skipped", "Skipped, empty params"
        if status:
            not_run(NotRun(task.name, status, reason))
        else:
            unran = tuple(t for t, s in statuses.items() if s in ("Omitted", "Skipped"))
            if strict_tags and (named := [t for t in unran if any(f"{{{{tasks.{t}." in v
                                                                  for v in task.arguments.values())]):
                raise RenderError(
                    f"task {task.name}'s arguments name {', '.join(named)}, which did not run: Argo from "
                    f"{STRICT_TAGS_TEXT} would requeue {task.name} and never start it (the run stays Running; "
                    "Netflix/metaflow#3043)")
            spec = templates(workflow)[task.template]
            for item in items:
                inputs = task_inputs(task, known if item is None else {**known, "item": str(item)}, unran)
                if "dag" in spec:
                    inner = walk(workflow, task.template, inputs, run, not_run, strict_tags)
                    produced = {p["name"]: fill(p["valueFrom"]["parameter"], {**inputs, **inner})
                                for p in (spec.get("outputs") or {}).get("parameters", [])}
                else:
                    produced = run(task, inputs, item)
                outputs.update({f"tasks.{task.name}.outputs.parameters.{k}": v for k, v in produced.items()})
            status = "Succeeded"  # a failed pod ends the walk (run raises): the DAG's failFast
            if task.with_param:
                fan_outs[task.name] = [status] * len(items)
        statuses[task.name] = outputs[f"tasks.{task.name}.status"] = status
    return outputs


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
