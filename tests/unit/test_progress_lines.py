"""The training process's progress lines (``[train] ...``), as a person watching a run reads them."""

from types import SimpleNamespace

from grpo_steps.training.callbacks import ProgressCallback


def test_a_line_when_training_starts_then_one_per_step(capsys, monkeypatch):
    clock = iter([31.5, 40.0, 52.0])
    monkeypatch.setattr("grpo_steps.training.callbacks.time.monotonic", lambda: next(clock))
    callback = ProgressCallback(started=0.0)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, max_steps=30)
    callback.on_train_begin(None, state, None)
    state.global_step = 1
    callback.on_step_end(None, state, None)
    state.global_step = 2
    callback.on_step_end(None, state, None)
    assert capsys.readouterr().out.splitlines() == [
        "[train] started at step 0/30 t=31.5s (imports, model and data loaded)",
        "[train] step 1/30 t=40.0s rate=40.0s/step eta=1160s",
        "[train] step 2/30 t=52.0s rate=12.0s/step eta=336s",
    ]


def test_other_processes_print_nothing(capsys):
    state = SimpleNamespace(is_world_process_zero=False, global_step=0, max_steps=30)
    ProgressCallback(started=0.0).on_train_begin(None, state, None)
    assert capsys.readouterr().out == ""
