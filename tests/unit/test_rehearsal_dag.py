"""The rehearsal's walk of a rendered DAG (grpo_steps/dev/rehearsal.py ``walk``, Argo's conditions read by
grpo_steps/dev/argo_expressions.py): the flow's switch after prepare_data as Argo runs it, on the DAG recorded from a
real render (tests/unit/data/grpoflow-dag.yaml, checked against each live render by
tests/integration/test_argo_render.py), and ``depends``/``when`` on small hand-written DAGs."""

from pathlib import Path

import pytest
import yaml
from metaflow.plugins.argo.conditional_input_paths import generate_input_paths

from grpo_steps.dev import rehearsal
from grpo_steps.dev.argo_expressions import depends_holds, expression_value, when_holds
from grpo_steps.dev.rehearsal import RenderError

RECORDED_DAG = Path(__file__).parent / "data" / "grpoflow-dag.yaml"
WORKFLOW = {"workflow.name": "grpo.user.ci.grpoflow-x7k2q", "retries": "0"}
RUN = "argo-grpo.user.ci.grpoflow-x7k2q"
SKIPPABLE = ["prepare_data"]
"""The steps before end that may not have run, as end's rendered command hands them to Metaflow's decoder
(tests/integration/test_rehearsal_specs.py reads them from the command)."""


def trimmed(workflow: dict) -> dict:
    """A rendered WorkflowTemplate's DAG: the entrypoint, the DAG templates whole, and of every other template a DAG
    task runs its name and output parameters (the exit hooks' templates vary with the config)."""
    run = {task["template"] for t in workflow["spec"]["templates"] if "dag" in t for task in t["dag"]["tasks"]}
    return {"spec": {"entrypoint": workflow["spec"]["entrypoint"], "templates": [
        t if "dag" in t else {"name": t["name"], "outputs": t.get("outputs") or {}}
        for t in workflow["spec"]["templates"] if "dag" in t or t["name"] in run]}}


def _walk(workflow: dict, outputs: dict[str, dict[str, str]], strict_tags: bool = False):
    """(tasks run as (task, input-paths), tasks not run as (task, status), statuses): each task that runs produces
    ``outputs[its name]`` (default: a task id); ``strict_tags`` as :func:`grpo_steps.dev.rehearsal.walk`'s."""
    ran, not_run = [], []

    def run(task, inputs, item):
        ran.append((task.name, inputs.get("inputs.parameters.input-paths")))
        return outputs.get(task.name, {"task-id": f"t-{task.name}"})

    result = rehearsal.walk(workflow, None, WORKFLOW, run, not_run.append, strict_tags)
    statuses = {k.split(".")[1]: v for k, v in result.items() if k.endswith(".status")}
    return ran, [(n.task, n.status) for n in not_run], statuses


def _flow_outputs(route: str) -> dict[str, dict[str, str]]:
    """What the flow's pods write: prepare_data's route (``switch-step``: the next step's name), one gang."""
    gang = {"num-parallel": "2", "task-id-entropy": "a1b2c3"}
    return {"prepare-data": {"task-id": "t-prepare-data", "switch-step": route},
            "provision-vllm": {"task-id": "t-provision-vllm", "num-splits": "[0]", **gang}, "train": gang}


def test_the_train_route_runs_every_step_from_provision_vllm_to_end():
    ran, not_run, statuses = _walk(yaml.safe_load(RECORDED_DAG.read_text()), _flow_outputs("provision_vllm"))
    assert [task for task, _ in ran] == ["start", "prepare-data", "provision-vllm", "train", "evaluate", "register",
                                         "end"]
    assert not_run == [] and set(statuses.values()) == {"Succeeded"}
    # end joins both of its inputs; Metaflow's decoder keeps register's (the conditional one that ran)
    assert ran[-1][1] == f"{RUN}/:prepare_data/t-prepare-data,register/t-register"
    assert generate_input_paths(ran[-1][1], SKIPPABLE) == f"{RUN}/register/t-register"


def test_the_no_new_rows_route_skips_training_and_runs_end():
    ran, not_run, statuses = _walk(yaml.safe_load(RECORDED_DAG.read_text()), _flow_outputs("end"))
    assert [task for task, _ in ran] == ["start", "prepare-data", "end"]
    # provision-vllm's when is false; the tasks after it depend on its success
    assert not_run == [("provision-vllm", "Skipped"), ("provision-vllm-foreach-parallel", "Omitted"),
                       ("evaluate", "Omitted"), ("register", "Omitted")]
    assert statuses["end"] == "Succeeded"
    # register's tag stays as written, as Argo leaves it, and Metaflow's decoder drops that path
    register = "{{tasks.register.outputs.parameters.task-id}}"
    assert ran[-1][1] == f"{RUN}/:prepare_data/t-prepare-data,register/{register}"
    assert generate_input_paths(ran[-1][1], SKIPPABLE) == f"{RUN}/prepare_data/t-prepare-data"


def test_on_argo_from_v3_7_11_the_train_route_runs_and_the_no_new_rows_route_hangs_in_end():
    """Argo's later patch releases resolve ``tasks.*`` tags strictly: every argument of the train route resolves; on the
    no_new_rows route, end's input paths name register, which did not run, so Argo would never start end (a scheduled
    run with nothing new would stay Running: docs/deploy.md "Argo's release")."""
    ran, not_run, statuses = _walk(yaml.safe_load(RECORDED_DAG.read_text()), _flow_outputs("provision_vllm"),
                                   strict_tags=True)
    assert ran[-1][0] == "end" and statuses["end"] == "Succeeded" and not not_run
    with pytest.raises(RenderError, match=r"task end's arguments name register, which did not run: Argo from "
                                          r"v3\.7\.11 and v4\.0\.2 would requeue end"):
        _walk(yaml.safe_load(RECORDED_DAG.read_text()), _flow_outputs("end"), strict_tags=True)


def _dag(*tasks: dict) -> dict:
    """A workflow of one DAG ``main`` of ``tasks``, each with a container template of its name."""
    return {"spec": {"entrypoint": "main", "templates": [
        {"name": "main", "dag": {"tasks": [{"template": t["name"], **t} for t in tasks]}},
        *({"name": t["name"], "container": {}} for t in tasks)]}}


def test_depends_with_or_and_a_bare_name_on_a_skipped_task():
    workflow = _dag({"name": "a"}, {"name": "b", "depends": "a", "when": "{{tasks.a.outputs.parameters.go}} == yes"},
                    {"name": "c", "depends": "b.Succeeded"},
                    {"name": "d", "depends": "c.Succeeded || b.Skipped", "when": "'{{tasks.b.status}}' != Succeeded"},
                    {"name": "e", "depends": "b"},  # a bare name: Succeeded, Skipped or Daemoned
                    {"name": "f", "dependencies": ["d", "e"]})
    ran, not_run, statuses = _walk(workflow, {"a": {"go": "no"}})
    assert [task for task, _ in ran] == ["a", "e", "d", "f"]  # in dag_tasks' order
    assert not_run == [("b", "Skipped"), ("c", "Omitted")]
    ran, not_run, _ = _walk(workflow, {"a": {"go": "yes"}})
    assert [task for task, _ in ran] == ["a", "b", "c", "e", "f"]  # f: d && e, and a skipped d counts
    assert not_run == [("d", "Skipped")]


@pytest.mark.parametrize(("depends", "statuses", "holds"), [
    ("a.Succeeded || b.Succeeded", {"a": "Omitted", "b": "Succeeded"}, True),
    ("a.Succeeded && b.Succeeded", {"a": "Omitted", "b": "Succeeded"}, False),
    ("a", {"a": "Skipped"}, True),  # bare: (a.Succeeded || a.Skipped || a.Daemoned)
    ("a", {"a": "Omitted"}, False),
    ("(a-1.Succeeded || a-1.Skipped) && !b.Errored", {"a-1": "Skipped", "b": "Error"}, False),  # Errored: phase Error
    ("a.Omitted", {"a": "Omitted"}, True),
])
def test_depends_reads_results_as_argo_does(depends, statuses, holds):
    assert depends_holds(depends, statuses) is holds


def test_a_fan_outs_any_succeeded_and_all_failed():
    assert depends_holds("a.AnySucceeded", {"a": "Failed"}, {"a": ["Failed", "Succeeded"]})
    assert not depends_holds("a.AllFailed", {"a": "Failed"}, {"a": ["Failed", "Succeeded"]})
    assert not depends_holds("a.AnySucceeded", {"a": "Succeeded"})  # not a fan-out: Argo counts no children


@pytest.mark.parametrize(("when", "holds"), [
    ("(Succeeded==Succeeded) || ((false))", True),  # end's when after register ran
    ("(Omitted==Succeeded) || ((true))", True),  # end's when on the no_new_rows route
    ("(Omitted==Succeeded) || ((false))", False),
    ("end==provision_vllm", False),  # bare words are strings (Argo's shouldExecute)
    ("'a b' == \"a b\" && !(x != x)", True),
])
def test_when_reads_as_govaluate_after_the_tags_are_filled(when, holds):
    assert when_holds(when) is holds


def test_a_switchs_route_is_read_as_expr_lang():
    route = "(tasks['p'].status == 'Succeeded' ? tasks['p'].outputs.parameters['switch-step'] : nil) == 'train'"
    values = {"tasks.p.status": "Succeeded", "tasks.p.outputs.parameters.switch-step": "train"}
    assert expression_value(route, values) == "true"
    assert expression_value(route, {**values, "tasks.p.status": "Failed"}) == "false"  # nil == 'train'


@pytest.mark.parametrize(("refused", "named"), [
    (lambda: when_holds("4 > 3"), "'> 3'"),  # govaluate's other operators
    (lambda: when_holds("a =~ b"), "'=~ b'"),
    (lambda: when_holds("Succeeded"), "'Succeeded' is not a boolean"),
    (lambda: when_holds("a ? b : c"), "'? b : c'"),  # govaluate's ternary is not read
    (lambda: depends_holds("a.Finished", {"a": "Succeeded"}), "'Finished' is not one of Argo's"),
    (lambda: depends_holds("a.Succeeded", {}), "task a has no status"),
    (lambda: expression_value("sprig.mul(2, 3)", {}), r"sprig.mul\(2 args\)"),
    (lambda: expression_value("tasks.a.status in ['Succeeded']", {"tasks.a.status": "x"}), r"at \"in \["),
])
def test_an_expression_outside_the_subset_is_refused_naming_it(refused, named):
    with pytest.raises(RenderError, match=named):
        refused()


def test_an_unsupported_when_in_a_dag_stops_the_walk_naming_it():
    workflow = _dag({"name": "a"}, {"name": "b", "depends": "a", "when": "{{tasks.a.outputs.parameters.n}} >= 2"})
    with pytest.raises(RenderError, match="'>= 2'"):
        _walk(workflow, {"a": {"n": "3"}})
