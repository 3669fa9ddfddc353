import threading
import time

import pytest

from grpo_steps.config import ConfigError, validate_config
from rewards import UnknownRewardError, bind_options, build_reward, guard
from rewards.guard import counters, guarded

_FOREVER = threading.Event()  # never set: a reward waiting on it hangs for good


def sleeps_forever(completions, **_):
    _FOREVER.wait()


def raises(completions, **_):
    raise RuntimeError("reward bug")


def wrong_length(completions, **_):
    return [1.0]


def ones(completions, **_):
    return [1.0] * len(completions)


def counts_its_own(completions, **_):
    guard.record("timeouts", 2)  # e.g. two sandboxed completions timed out
    return [0.0] * len(completions)


GUARD_CASES = [
    (sleeps_forever, [None, None], "timeouts", 1),  # hangs: Nones after the limit, one timeout
    (raises, [None, None], "errors", 1),  # raises: Nones, one error
    (ones, [1.0, 1.0], "errors", 0),  # healthy: scores pass through, nothing counted
    (counts_its_own, [0.0, 0.0], "timeouts", 2),  # per-completion failures reported by the reward itself
]


@pytest.mark.parametrize(("fn", "expected", "kind", "count"), GUARD_CASES)
def test_guard_returns_within_its_limit_and_counts(fn, expected, kind, count):
    name = f"guard_case_{fn.__name__}"
    key = f"rewards/{name}/{kind}"
    before = counters().get(key, 0)
    logged = {}
    start = time.perf_counter()
    scores = guarded(fn, name, timeout_s=0.3)(completions=["a", "b"], log_metric=logged.__setitem__)
    assert time.perf_counter() - start < 2
    assert scores == expected
    assert counters().get(key, 0) == before + count
    assert logged[key] == count  # what TRL's log_metric receives for this call


RETURN_ERRORS = [
    # (reward, text the error must contain besides the reward's name)
    (wrong_length, "returned 1 scores for 2 completions: [1.0]"),  # one score for two completions
    (lambda completions, **_: 1.0, "returned 1.0 (float)"),  # a bare float
    (lambda completions, **_: None, "returned None (NoneType)"),  # forgot the return
    (lambda completions, **_: ["1", "0"], "returned str scores such as '1'"),  # strings
    (lambda completions, **_: [True, False], "returned bool scores such as True"),  # booleans are not scores
]


@pytest.mark.parametrize(("fn", "message"), RETURN_ERRORS)
def test_a_reward_returning_the_wrong_shape_or_type_is_an_error_naming_it(fn, message):
    with pytest.raises(guard.RewardReturnError) as err:
        guarded(fn, "my_reward", timeout_s=5)(completions=["a", "b"])
    assert "reward 'my_reward' " in str(err.value) and message in str(err.value)


def test_guard_keeps_the_configured_name_and_rejects_a_bad_limit():
    assert guarded(ones, "my_reward").__name__ == "my_reward"
    with pytest.raises(ValueError, match="timeout_s"):
        guarded(ones, "x", timeout_s=0)


OPTION_CASES = [
    ("soft_overlong_punishment", {"max_completion_len": 8}, "soft_punish_cache"),  # required option missing
    ("soft_overlong_punishment", {"max_completion_len": 8, "soft_punish_cache": 2, "typo": 1}, "typo"),  # unknown
    ("answer_accuracy", {"threshold": 0.5}, "unknown options"),  # an option the reward does not have
    ("code_execution", {"completions": []}, "completions"),  # per-call arguments are not options
    ("reward_model", {}, "model"),  # reward_model needs its model
]


@pytest.mark.parametrize(("name", "options", "message"), OPTION_CASES)
def test_bad_options_are_rejected_at_config_time(name, options, message):
    with pytest.raises(ConfigError, match=message):
        validate_config({"rewards": [{"name": name, "options": options}], "eval": {"format_reward": None,
                                                                                  "correctness_reward": name}})
    with pytest.raises(UnknownRewardError, match=message):
        from rewards import resolve_reward

        bind_options(resolve_reward(name), options, name)


def test_training_path_builds_guarded_named_rewards_from_the_config():
    from grpo_steps.training.entry import reward_functions

    cfg = validate_config({
        "rewards": [
            {"name": "math_accuracy"},
            {"name": "think_answer_format", "weight": 0.2},
            {"name": "soft_overlong_punishment", "options": {"max_completion_len": 4, "soft_punish_cache": 2},
             "timeout_s": 5},
            {"name": "tests.unit.test_guard:raises"},
        ],
        "eval": {"correctness_reward": "math_accuracy", "format_reward": "think_answer_format"},
    })
    funcs = reward_functions(cfg)
    assert [f.__name__ for f in funcs] == ["math_accuracy", "think_answer_format", "soft_overlong_punishment",
                                           "tests.unit.test_guard:raises"]
    # Called as GRPOTrainer._calculate_rewards calls them (keywords only, extra trainer arguments).
    logged = {}
    kwargs = dict(prompts=["q", "q"], completions=["<think>a</think><answer>2</answer>", "Answer: 3"],
                  completion_ids=[[1, 2, 3], [1] * 5], answer=["2", "3"], trainer_state=None,
                  log_extra=lambda *a: None, log_metric=logged.__setitem__)
    assert [f(**kwargs) for f in funcs] == [[0.0, 1.0], [1.0, 0.0], [-0.5, -1.0], [None, None]]
    assert logged["rewards/tests.unit.test_guard:raises/errors"] == 1.0
    assert logged["rewards/math_accuracy/timeouts"] == 0.0


def test_evaluation_scores_with_the_same_built_rewards():
    from grpo_steps.evaluation.scoring import score

    cfg = validate_config({
        "rewards": [{"name": "answer_accuracy"},
                    {"name": "soft_overlong_punishment", "options": {"max_completion_len": 4, "soft_punish_cache": 2}}],
        "eval": {"format_reward": None},
    })
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}]
    out = score(cfg, rows, [["Answer: 2", "Answer: 3"]], [[[1, 2, 3], [1]]])
    assert out == {"answer_accuracy": [[1.0, 0.0]], "soft_overlong_punishment": [[-0.5, 0.0]]}
    assert score(cfg, rows, [["Answer: 2"]])["soft_overlong_punishment"] == [[None]]  # no token ids: n/a


def test_build_reward_binds_options():
    cfg = validate_config({"rewards": [{"name": "soft_overlong_punishment", "timeout_s": 1,
                                        "options": {"max_completion_len": 10, "soft_punish_cache": 5}}],
                           "eval": {"correctness_reward": "soft_overlong_punishment", "format_reward": None}})
    assert build_reward(cfg.rewards[0])(completions=["a"], completion_ids=[[0] * 9]) == [-0.8]


def test_multi_objective_aggregation_passes_through_to_grpo_config(tmp_path):
    from grpo_steps.training.job import TrainJob, grpo_args

    cfg = validate_config({"train": {"grpo": {"multi_objective_aggregation": "normalize_then_sum"}}})
    job = TrainJob(config=cfg, model_path="unused", train_file="unused", output_dir=str(tmp_path))
    assert grpo_args(job).multi_objective_aggregation == "normalize_then_sum"


def no_kwargs(completions, answer):
    return [1.0] * len(completions)


def no_positional(*, completions, **_):
    return [1.0] * len(completions)


def needs_a_missing_column(completions, rubric, **_):
    return [1.0] * len(completions)


def takes_a_kept_column(completions, solution, **_):
    return [1.0] * len(completions)


SIGNATURE_CASES = [
    # (dotted-path reward in this module, text of the config error)
    ("no_kwargs", "add a var-keyword parameter such as **kwargs"),  # TRL passes prompts, ... by keyword
    ("no_positional", "no positional parameter for the completions"),  # the guard passes them by position
    ("needs_a_missing_column", "it requires ['rubric'], which no prepared row has"),  # no row has `rubric`
]


@pytest.mark.parametrize(("fn", "message"), SIGNATURE_CASES)
def test_a_reward_whose_signature_cannot_take_the_call_is_rejected_at_config_time(fn, message):
    with pytest.raises(ConfigError) as err:
        validate_config({"rewards": [{"name": f"tests.unit.test_guard:{fn}"}],
                         "eval": {"format_reward": None, "correctness_reward": f"tests.unit.test_guard:{fn}"}})
    assert f"reward 'tests.unit.test_guard:{fn}' has the signature" in str(err.value)
    assert message in str(err.value)


def test_a_required_column_the_data_keeps_is_accepted():
    name = "tests.unit.test_guard:takes_a_kept_column"
    validate_config({"data": {"answer_format": "gsm8k"}, "rewards": [{"name": name}],  # gsm8k keeps `solution`
                     "eval": {"format_reward": None, "correctness_reward": name}})


# --- non-finite scores: counted as errors, warned once, and left unscored --------------------------------------

def third_nan(completions, **_):
    return [float("nan") if i % 3 == 0 else 1.0 for i in range(len(completions))]


def all_inf(completions, **_):
    return [float("inf")] * len(completions)


def test_nan_scores_are_counted_as_errors_and_warned_once_with_the_name(caplog):
    name = "guard_case_third_nan"
    reward = guarded(third_nan, name, timeout_s=5)
    logged = {}
    with caplog.at_level("WARNING", logger="rewards.guard"):
        scores = reward(completions=["a"] * 6, log_metric=logged.__setitem__)
        reward(completions=["a"] * 6)
    assert scores == [None, 1.0, 1.0, None, 1.0, 1.0]  # not averaged in as 1.0 by TRL's nanmean
    assert counters()[f"rewards/{name}/errors"] == 4  # 2 per call, per completion
    assert logged[f"rewards/{name}/errors"] == 2
    assert guard.scored()[name] == (12, 4)
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warnings) == 1 and "returned 2 non-finite scores (nan, nan) of 6" in warnings[0]


def test_a_reward_returning_only_inf_trips_the_all_none_stop():
    from types import SimpleNamespace

    from grpo_steps.training.callbacks import AllNoneStop, AllRewardsNone

    stop = AllNoneStop(limit=2)
    reward = guarded(all_inf, "guard_case_all_inf", timeout_s=5)
    assert reward(completions=["a", "b"]) == [None, None]
    stop.on_step_end(None, SimpleNamespace(global_step=1), None)
    reward(completions=["a", "b"])
    with pytest.raises(AllRewardsNone, match=r"guard_case_all_inf.*'rewards/guard_case_all_inf/errors': 4"):
        stop.on_step_end(None, SimpleNamespace(global_step=2), None)


def test_the_all_none_stop_names_only_the_rewards_of_its_own_steps():
    """Reward counts are the process's: a reward an earlier job in the same process ran (a notebook, a bench, a test
    session) is not named among the rewards that scored None in this job's steps."""
    from types import SimpleNamespace

    from grpo_steps.training.callbacks import AllNoneStop, AllRewardsNone

    guarded(lambda completions, **_: [1.0] * len(completions), "guard_case_earlier_job", timeout_s=5)(["a"])
    stop = AllNoneStop(limit=2)
    never = guarded(lambda completions, **_: [None] * len(completions), "guard_case_never_applies", timeout_s=5)
    never(completions=["a", "b"])
    stop.on_step_end(None, SimpleNamespace(global_step=1), None)
    never(completions=["a", "b"])
    with pytest.raises(AllRewardsNone) as err:
        stop.on_step_end(None, SimpleNamespace(global_step=2), None)
    assert "every reward (guard_case_never_applies) scored None for every completion in steps 1..2" in str(err.value)
