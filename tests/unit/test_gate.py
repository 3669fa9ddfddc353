"""The registry's quality gate on per-prompt scores (paired 95 % interval), and ``champion`` moved by
compare-and-set: two registrations at once against one real MLflow store end with the better one as champion."""

import multiprocessing
import time
import traceback

import pytest

from grpo_steps.config import ConfigError, validate_config
from grpo_steps.gate import gate

Z20 = [0.0] * 20

GATE_CASES = [
    # (trained, baseline, champion, margin, passes) per-prompt pass@1
    ([0.5] + [0.0] * 19, Z20, None, 0.0, False),  # the user's run: +0.025 on 20 prompts, inside its interval
    ([1.0] * 10 + [0.0] * 10, Z20, None, 0.0, True),  # +0.5 on 20 prompts: lower bound well above 0
    ([1.0] * 10 + [0.0] * 10, Z20, None, 0.4, False),  # ... but not above a 0.4 margin (lower bound ~0.27)
    ([1.0] * 20, Z20, None, 0.0, True),  # every prompt gains: narrow, never zero width
    ([1.0] * 2, [0.0] * 2, None, 0.0, False),  # two prompts that both gained: no +1.000 +- 0.000 pass
    ([1.0] * 4 + [0.9] * 4, [0.0] * 8, None, 0.5, True),  # eight prompts, all well above the margin
    (Z20, Z20, None, 0.0, False),  # no gain
    ([1.0] * 20, Z20, [1.0] * 20, 0.0, False),  # beats the baseline, ties the champion
    ([1.0] * 20, Z20, [1.0] * 10 + [0.0] * 10, 0.0, True),  # beats baseline and champion on the same prompts
    ([1.0] * 20, Z20, [0.9] * 20, 0.0, True),  # beats the champion by 0.1 on every prompt
    ([1.0], [0.0], None, 0.0, False),  # one prompt: no interval, never passes
]


@pytest.mark.parametrize(("trained", "baseline", "champion", "margin", "passes"), GATE_CASES)
def test_quality_gate(trained, baseline, champion, margin, passes):
    assert gate(trained, baseline, champion, margin)[0] is passes


def test_the_gate_says_why():
    passed, reason = gate([0.5] + [0.0] * 19, Z20, None, 0.0)
    assert not passed
    assert "gain over the baseline +0.025 ± 0.052" in reason  # t(0.975, 19) = 2.093, not 1.96
    assert "does not beat registry.min_improvement 0.000" in reason


def test_a_champion_on_other_prompts_holds():
    passed, reason = gate([1.0] * 20, Z20, None, 0.0, champion_note="the champion was evaluated on other prompts")
    assert not passed and "other prompts" in reason


@pytest.mark.parametrize("margin", [-0.5, -1e-9, 1.5])
def test_min_improvement_is_bounded_to_0_1(margin):
    with pytest.raises(ConfigError, match="registry.min_improvement"):
        validate_config({"registry": {"min_improvement": margin}})


def test_settle_reads_again_when_another_registrar_created_the_alias_first(tmp_path, mlflow_db):
    """On SQLite two first writes of ``champion`` race on its unique key: the loser's write raises. It must read
    the alias and the contenders again, not fail the registration."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from grpo_steps.gate import COMPARED_TAG, PASSED_TAG, SCORE_TAG, settle_champion

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("policy")
    run = client.create_run("0")
    for score in ("0.5", "0.8"):  # versions 1 and 2: 2 is the better contender
        client.create_model_version("policy", f"runs:/{run.info.run_id}/model", run.info.run_id,
                                    tags={PASSED_TAG: "true", SCORE_TAG: score, COMPARED_TAG: ""})
    original, calls = client.set_registered_model_alias, []

    def loses_the_first_insert(name, alias, version):
        calls.append(version)
        if len(calls) == 1:  # the other registrar inserts its (weaker) choice between our read and our write
            original(name, alias, "1")
            raise MlflowException("UNIQUE constraint failed: registered_model_aliases.alias")
        original(name, alias, version)

    client.set_registered_model_alias = loses_the_first_insert
    assert settle_champion(client, "policy", "2", None) == "2"
    assert calls == ["2", "2"] and str(client.get_model_version_by_alias("policy", "champion").version) == "2"


def test_settle_fails_when_the_alias_write_fails_and_nobody_else_wrote_it(tmp_path, mlflow_db):
    """Any MLflow error used to count as a clash: a registrar without the right to set aliases ended as if another
    one had won, and the registration reported success."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from grpo_steps.gate import COMPARED_TAG, PASSED_TAG, SCORE_TAG, SETTLED_TAG, settle_champion

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("policy")
    run = client.create_run("0")
    client.create_model_version("policy", f"runs:/{run.info.run_id}/model", run.info.run_id,
                                tags={PASSED_TAG: "true", SCORE_TAG: "0.5", COMPARED_TAG: ""})

    def refused(name, alias, version):
        raise MlflowException("PERMISSION_DENIED: the user may not set aliases")

    client.set_registered_model_alias = refused
    with pytest.raises(MlflowException, match="PERMISSION_DENIED"):
        settle_champion(client, "policy", "1", None)
    assert client.get_model_version("policy", "1").tags.get(SETTLED_TAG) is None  # not marked settled


def _register(db: str, label: str, scores: list[float], barrier, write_delay_s: float, out) -> None:
    """One registrar in its own process: a run with per-prompt scores, a version, then the gate and the move of
    champion (``grpo_steps.register._decide``); ``write_delay_s`` delays its alias writes (a slow registrar)."""
    from mlflow import MlflowClient

    from grpo_steps.config import validate_config
    from grpo_steps.gate import save_per_prompt
    from grpo_steps.register import _decide

    cfg = validate_config({"tracking": {"tracking_uri": db}, "registry": {"model_name": "policy"}})
    client = MlflowClient(db)
    run = client.create_run("0", tags={"label": label})
    keys = [f"p{i}" for i in range(len(scores))]
    save_per_prompt(client, run.info.run_id, keys, scores)
    version = client.create_model_version("policy", f"runs:/{run.info.run_id}/model", run.info.run_id,
                                          tags={"eval.pass_at_1": f"{sum(scores) / len(scores):.6g}", "label": label})
    report = {"trained": {"per_prompt": {"pass@1": scores}, "prompt_keys": keys},
              "baseline": {"per_prompt": {"pass@1": [0.0] * len(scores)}}}
    if write_delay_s:
        original = client.set_registered_model_alias

        def slow(*args):
            time.sleep(write_delay_s)
            original(*args)

        client.set_registered_model_alias = slow
    barrier.wait(timeout=120)
    try:
        out.put((label, version.version, _decide(cfg, client, "policy", str(version.version), report)))
    except Exception:  # noqa: BLE001 - the parent reports it at once instead of waiting for a result
        out.put((label, version.version, traceback.format_exc()))


@pytest.mark.slow  # two processes importing MLflow, ~15 s a case
@pytest.mark.parametrize(("better_delay", "weaker_delay"), [(0, 0), (0, 1.5)],
                         ids=["together", "weaker-writes-late"])  # both fail when each registrar just sets the alias
def test_two_concurrent_registrations_end_with_the_better_as_champion(tmp_path, mlflow_db, better_delay, weaker_delay):
    from mlflow import MlflowClient

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(db)  # the store and the model exist before the two registrars race
    client.create_registered_model("policy")
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(2), context.Queue()
    better, weaker = [1.0] * 16 + [0.0] * 4, [1.0] * 10 + [0.0] * 10  # both beat the baseline of zeros
    procs = [context.Process(target=_register, args=(db, label, scores, barrier, delay, out))
             for label, scores, delay in (("better", better, better_delay), ("weaker", weaker, weaker_delay))]
    for proc in procs:
        proc.start()
    results = {label: (version, decision) for label, version, decision in (out.get(timeout=180) for _ in procs)}
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    champion = client.get_model_version_by_alias("policy", "champion")
    assert champion.tags["label"] == "better"
    failed = {label: decision for label, (_, decision) in results.items() if isinstance(decision, str)}
    assert not failed, failed
    for version, (passed, reason, _) in results.values():
        tags = client.get_model_version("policy", version).tags
        assert tags["gate.passed"] == str(passed).lower() and tags["gate.reason"] == reason  # recorded


def _open_run(db: str, barrier, out) -> None:
    from mlflow import MlflowClient

    from grpo_steps import tracking
    from grpo_steps.config import validate_config

    cfg = validate_config({"tracking": {"tracking_uri": db, "experiment_name": "race"}})
    tracking.client(cfg)  # the store's own schema first: this test is about the experiment
    lookup, calls = MlflowClient.get_experiment_by_name, []

    def first_sees_none(self, name):  # both registrars look before either creates: the race, every time
        calls.append(name)
        return None if len(calls) == 1 else lookup(self, name)

    MlflowClient.get_experiment_by_name = first_sees_none
    barrier.wait(timeout=120)
    out.put(tracking.open_run(cfg, "GRPOFlow/1/start/1"))


@pytest.mark.slow  # two processes importing MLflow
def test_two_runs_on_a_fresh_store_both_open_in_one_experiment(tmp_path):
    from mlflow import MlflowClient

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(db).search_experiments()  # creates the store's tables; the experiment "race" does not exist
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(2), context.Queue()
    procs = [context.Process(target=_open_run, args=(db, barrier, out)) for _ in range(2)]
    for proc in procs:
        proc.start()
    run_ids = [out.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    client = MlflowClient(db)
    experiment = client.get_experiment_by_name("race")
    assert {client.get_run(r).info.experiment_id for r in run_ids} == {experiment.experiment_id}


def _registrar(tmp_path):
    """Register versions one after the other on a real MLflow store, as the register step does
    (``grpo_steps.register._decide``); returns ``register(scores) -> (version, passed, champion)`` and the client."""
    from mlflow import MlflowClient

    from grpo_steps.gate import save_per_prompt
    from grpo_steps.register import _decide

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = validate_config({"tracking": {"tracking_uri": db}, "registry": {"model_name": "policy"}})
    client = MlflowClient(db)
    client.create_registered_model("policy")

    def register(scores: list[float]) -> tuple[str, bool, str | None]:
        run = client.create_run("0")
        keys = [f"p{i}" for i in range(len(scores))]
        save_per_prompt(client, run.info.run_id, keys, scores)
        version = str(client.create_model_version(
            "policy", f"runs:/{run.info.run_id}/model", run.info.run_id,
            tags={"eval.pass_at_1": f"{sum(scores) / len(scores):.6g}"}).version)
        report = {"trained": {"per_prompt": {"pass@1": scores}, "prompt_keys": keys},
                  "baseline": {"per_prompt": {"pass@1": [0.0] * len(scores)}}}
        passed, _, champion = _decide(cfg, client, "policy", version, report)
        return version, passed, champion

    return register, client


def test_after_a_manual_rollback_the_next_registration_does_not_restore_the_rolled_back_version(tmp_path, mlflow_db):
    register, client = _registrar(tmp_path)
    assert register([0.5] * 10 + [0.0] * 10) == ("1", True, "1")
    assert register([1.0] * 20) == ("2", True, "2")  # v2 beats v1 on every prompt
    client.set_registered_model_alias("policy", "champion", "1")  # the team rolls back v2 -> v1 by hand
    assert register([1.0] * 16 + [0.5] * 4) == ("3", True, "3")  # v3 beats v1: champion v3, never v2 (better)
    client.set_registered_model_alias("policy", "champion", "1")  # rolled back again, v3 revoked this time
    client.set_model_version_tag("policy", "3", "gate.revoked", "true")
    assert register([0.9] * 20) == ("4", True, "4")  # v4 beats v1; v3 (revoked) and v2 (rolled back) stay out
    client.set_registered_model_alias("policy", "champion", "3")  # a revoked champion, still aliased by mistake
    assert register([1.0] * 20) == ("5", True, "5")  # v5 beats it and replaces it


def test_without_a_champion_the_new_version_is_judged_on_its_own_comparison_not_the_all_time_best(tmp_path, mlflow_db):
    register, client = _registrar(tmp_path)
    assert register([1.0] * 20) == ("1", True, "1")  # the all-time best
    client.delete_registered_model_alias("policy", "champion")  # the team clears the alias
    assert register([0.5] * 20) == ("2", True, "2")  # v2 passed against the baseline: v2, not v1


def test_a_gate_on_fewer_prompts_than_registry_min_eval_prompts_holds():
    passed, reason = gate([1.0] * 6, [0.0] * 6, None, 0.0, min_prompts=8)
    assert not passed and "registry.min_eval_prompts (8)" in reason
    assert gate([1.0] * 8, [0.0] * 8, None, 0.0, min_prompts=8)[0]


def test_an_eval_split_below_registry_min_eval_prompts_is_refused_in_start():
    with pytest.raises(ConfigError, match=r"data.num_eval \(4\) is below registry.min_eval_prompts \(8\)"):
        validate_config({"data": {"num_eval": 4}})
    validate_config({"data": {"num_eval": 4}, "registry": {"min_eval_prompts": 4}})


@pytest.mark.parametrize("name", ["o'brien-policy", 'say"cheese', "back\\slash", "tab\tname"])
def test_registry_names_that_break_mlflow_filters_are_refused_in_start(name):
    with pytest.raises(ConfigError, match="registry.model_name"):
        validate_config({"registry": {"model_name": name}})


def test_a_revoked_champion_is_never_compared_with(tmp_path, mlflow_db):
    register, client = _registrar(tmp_path)
    assert register([1.0] * 20) == ("1", True, "1")
    client.set_model_version_tag("policy", "1", "gate.revoked", "true")  # revoked, the alias not moved back yet
    assert register([0.5] * 20) == ("2", True, "2")  # judged against the baseline alone: v1's 1.0 would beat it
    assert client.get_model_version("policy", "2").tags["gate.compared_champion"] == ""
