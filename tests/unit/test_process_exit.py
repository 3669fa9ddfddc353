"""What every pipeline process does at its exit and on its imports (``grpo_steps/__init__.py``)."""

import subprocess
import sys

import pytest


def test_a_pipeline_process_freezes_its_objects_at_exit_after_the_libraries_exit_handlers():
    # atexit runs last in, first out: a handler registered before grpo_steps is imported runs after its freeze; one
    # registered later (a library's: MLflow's flush, Metaflow's) runs before it, its objects still collectable
    probe = ("import atexit, gc\n"
             "atexit.register(lambda: print('last', gc.get_freeze_count() > 0))\n"
             "import grpo_steps\n"
             "atexit.register(lambda: print('library', gc.get_freeze_count()))\n"
             "cycle = []\ncycle.append(cycle)\n")  # alive at exit, as every imported module's objects are
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["library", "0", "last", "True"], out.stderr


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_a_pipeline_process_loads_a_tokenizer_without_importing_scikit_learn(tiny_model_path):
    """transformers' assisted-generation module imports ``sklearn.metrics`` (with scipy.stats and pandas) whenever
    scikit-learn is installed; in a process that imported grpo_steps first it is told scikit-learn is absent, and the
    tokenizer still loads. scikit-learn is installed (MLflow requires it): the hook, not its absence, kept it out."""
    probe = ("import grpo_steps, importlib.util, sys\n"
             "from transformers import AutoTokenizer\n"
             f"assert AutoTokenizer.from_pretrained({tiny_model_path!r})('1 + 1')['input_ids']\n"
             "print(importlib.util.find_spec('sklearn') is not None, 'sklearn' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["True", "False"], out.stderr[-2000:]
