"""What every pipeline process does at its exit (``grpo_steps/__init__.py``)."""

import subprocess
import sys


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
