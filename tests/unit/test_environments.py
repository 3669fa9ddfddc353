"""Environments in worker processes (grpo_steps/tools/environments.py; the games of grpo_steps/tools/games.py): a
TextArena game plays through the adapter with its feedback, invalid moves and a solved outcome; an episode over its
wall clock ends, is scored failed and counted, and leaves no process or thread behind; a tool's exit is the call's
error and its answer is cut; sampled episodes are traced in MLflow with a span per turn."""

import threading
import time

import psutil
import pytest

from grpo_steps.config import validate_config
from grpo_steps.evaluation.episodes import Episode, game_metrics
from grpo_steps.tools.environments import environment_factories
from grpo_steps.tools.games import TEXTARENA
from grpo_steps.tools.worker import TRUNCATED
from rewards.game import game_invalid_moves, game_solved


def _game(spec: str, tool_timeout_s: float = 30, episode_s: float | None = None):
    (factory,) = environment_factories(spec, tool_timeout_s, 4096, episode_s).values()
    return factory()


def test_a_textarena_game_plays_with_its_feedback_and_counts_invalid_moves_and_a_win():
    game = _game(TEXTARENA + "GuessTheNumber-v0")
    assert type(game).__name__ == "GuessTheNumber-v0"
    first = game.reset(seed=7)
    assert "Guess The Number" in first
    low, high, answers = 1, 20, []
    answers.append(game.move("twelve"))  # refused: TextArena wants a number
    while not game.outcome["solved"]:  # binary search on the game's feedback
        guess = (low + high) // 2
        answers.append(game.move(f"[{guess}]"))
        if "higher" in answers[-1]:
            low = guess + 1
        elif "lower" in answers[-1]:
            high = guess - 1
    outcome = game.outcome
    assert "invalid move" in answers[0] and outcome["invalid_moves"] == 1
    assert outcome["solved"] and outcome["moves"] == len(answers) <= 6 and not outcome["timed_out"]
    assert game_solved([""], environments=[game]) == [1.0] and game_invalid_moves([""], environments=[game]) == [-1.0]
    with pytest.raises(RuntimeError, match="the game is over"):
        game.move("[1]")
    # the same worker, a new game: its observation holds nothing of the game before (TextArena's wrapper keeps it)
    assert game.reset(seed=7) == first and game.outcome["moves"] == 0
    assert "Guess The Number" in game.reset(seed=8) and "[Player]" not in game.reset(seed=8)
    game._close()


def test_an_episode_over_its_wall_clock_ends_scored_failed_counted_and_leaves_nothing_behind():
    threads = threading.active_count()
    game = _game("gym:tests.unit.toy_games:Stuck", tool_timeout_s=30, episode_s=1.0)
    game.reset(seed=0)
    pid = game._process.proc.pid
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="over its wall clock of 1 s .* in a move that was killed"):
        game.move("wait")
    assert time.monotonic() - started < 30  # the episode's clock, not the call's 30 s
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert threading.active_count() == threads
    with pytest.raises(RuntimeError, match="the episode is over"):
        game.move("win")
    assert game.get_reward() == 0.0 and game.outcome["timed_out"] and not game.outcome["solved"]
    metrics = game_metrics([Episode(environment=game)])
    assert metrics["game/timed_out"] == 1.0 and metrics["game/solve_rate"] == 0.0
    assert game.reset(seed=1) == "\nSay anything." and game.move("win") == "won"  # a fresh worker, a new episode
    assert game.outcome["solved"] and game.get_reward() == 1.0
    game._close()


def test_an_environment_tool_is_cut_and_its_exit_is_an_error():
    """A tool of an environment that raises ``SystemExit`` answers with the error (the worker process goes on); an
    answer over ``generation.max_tool_response_length`` characters is cut before it leaves the environment."""
    (factory,) = environment_factories("tests.unit.toy_games:Loud", 30, 10).values()
    game = factory()
    try:
        game.reset()
        with pytest.raises(RuntimeError, match="raised SystemExit: 4"):
            game.leave(4)
        assert game.huge(50) == "y" * 10 + TRUNCATED
        assert game.huge(5) == "y" * 5
    finally:
        game._close()


def test_sampled_episodes_are_traced_in_mlflow_with_a_span_per_turn(mlflow_db):
    import mlflow

    from grpo_steps.evaluation.traces import episode_traces, log_traces

    cfg = validate_config({"tracking": {"tracking_uri": mlflow_db}, "eval": {"num_traces": 2}})
    client = mlflow.MlflowClient(mlflow_db)
    run_id = client.create_run(client.create_experiment("traces")).info.run_id
    game = _game("gym:tests.unit.toy_games:Stuck")
    rows, sampled = [], []
    for index in range(3):
        observation = game.reset(seed=index)
        rows.append({"prompt": [{"role": "user", "content": f"Game {index}.{observation}"}]})
        call = {"type": "function", "function": {"name": "move", "arguments": {"action": "win"}}}
        episode = Episode(messages=[{"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "name": "move", "content": game.move("win")},
                                    {"role": "assistant", "content": "I won."}], turns=2, turn_tokens=[12, 4],
                          environment=game)
        sampled.append([episode])
        if index < 2:  # the traces are taken while the episode's environment holds its state
            traces = episode_traces(cfg, rows, sampled)
    assert len(traces) == 2
    ids = log_traces(cfg, run_id, "baseline", traces)
    found = mlflow.MlflowClient(mlflow_db).search_traces(locations=[client.get_run(run_id).info.experiment_id],
                                                         run_id=run_id)
    assert sorted(t.info.trace_id for t in found) == sorted(ids)
    trace = mlflow.MlflowClient(mlflow_db).get_trace(ids[1])
    turns = sorted((s for s in trace.data.spans if s.name.startswith("turn")), key=lambda s: s.name)
    assert [s.name for s in turns] == ["turn 1", "turn 2"]
    assert turns[0].inputs == {"observation": "Game 1.\nSay anything."}
    assert turns[0].outputs == {"action": 'move({"action": "win"})'}
    assert turns[0].attributes["reward"] == 1.0 and turns[0].attributes["tokens"] == 12
    assert turns[1].inputs == {"observation": "move: won"} and turns[1].attributes["tokens"] == 4
    assert trace.info.tags["grpo.policy"] == "baseline"
    game._close()


def test_an_episode_clock_without_an_environment_is_refused():
    """``generation.episode_timeout_s`` limits an environment's episodes: a config without one is refused in
    ``start``, naming the key, rather than accepted and ignored."""
    from grpo_steps.config import ConfigError
    from tests.integration.flowrun import flow_config

    config = flow_config(generation={"episode_timeout_s": 30})
    with pytest.raises(ConfigError, match="generation.episode_timeout_s 30 limits an environment's episodes"):
        validate_config(config)
    config["environment"] = "gym:tests.unit.toy_games:Stuck"
    config["generation"]["max_completion_tokens"] = 12
    assert validate_config(config).generation.episode_timeout_s == 30


def test_per_turn_credit_needs_an_environment_and_per_token_advantages():
    """``train.turn_credit`` credits an environment's moves per turn, making the advantages per token: refused in
    ``start`` without an environment, and with the settings that read one advantage per completion."""
    from grpo_steps.config import ConfigError
    from tests.integration.flowrun import flow_config

    config = flow_config(train={"turn_credit": 0.5})
    with pytest.raises(ConfigError, match="train.turn_credit 0.5 credits the moves of an environment's game"):
        validate_config(config)
    config["environment"] = "gym:tests.unit.toy_games:Countdown"
    config["generation"]["max_completion_tokens"] = 12
    assert validate_config(config).train.turn_credit == 0.5
    for setting, message in (({"zero_signal_groups": "resample"}, "zero_signal_groups 'resample'"),
                             ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
                             ({"loss_type": "vespo"}, "loss_type 'vespo'")):
        refused = {**config, "train": {**config["train"], **setting}}
        with pytest.raises(ConfigError, match=f"turn_credit makes the advantages per token, and train.{message}"):
            validate_config(refused)


def test_routed_environments_reset_ahead_go_to_their_own_pools_and_close():
    """``generation.async`` with several environments (:class:`EpisodesAhead`, routed by the ``environment``
    column): each row's own environment is reset ahead (the column not passed to ``reset``), its observation joined
    to the row's prompt; the trainer's pools get each instance under the environment it was made for; a batch the
    trainer moved past has its worker processes killed."""
    from grpo_steps.training.generation.episodes_ahead import EpisodesAhead

    factories = environment_factories({"board": "tests.unit.toy_games:Board",
                                       "count": "gym:tests.unit.toy_games:Countdown"}, 30, 4096)
    episodes = EpisodesAhead(factories, routed=True)
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "seed": seed, "environment": name}
            for seed, name in ((1, "count"), (2, "board"), (3, "count"))]
    prompts = episodes.first_prompts(4, rows)
    assert [p[-1]["content"] for p in prompts] == ["Play.\nGuess a number from 1 to 4 (game 1).",
                                                  "Play. The board of game 2 is ready.",
                                                  "Play.\nGuess a number from 1 to 4 (game 3)."]
    assert rows[0]["prompt"][-1]["content"] == "Play."  # the rows are left untouched
    pools = episodes.pools(episodes.ahead[4])
    assert [type(i).__name__ for i in pools["count"]] == ["Countdown", "Countdown"]
    assert [type(i).__name__ for i in pools["board"]] == ["Board"]
    trl_row = {k: v for k, v in rows[1].items() if k != "environment"}  # TRL's reset_kwargs in routed mode
    assert pools["board"][0].reset(**trl_row) == " The board of game 2 is ready."  # the episode made ahead
    assert pools["board"][0].move("x") == "game 2, reset 1 time(s)"
    pids = [instance._process.proc.pid for _, instance in episodes.ahead[4]]
    episodes.discard_through(4)
    assert not episodes.ahead
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
