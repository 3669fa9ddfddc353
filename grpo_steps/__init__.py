"""GRPO pipeline: one module per concern on the flow side (config, sources, data, models, evaluate,
report, register, tracking, checkpoints, launch, lora, monitor, processes, deploy); ``steps`` holds the step bodies
the flow calls; ``weights`` the weight path's files, S3 chain, labels and server flags; ``servers`` the generation
server and its client; ``training`` what runs in the training process
(reached from the flow side only through ``training.job``)."""

import atexit
import gc
import sys

METAFLOW_PACKAGE_POLICY = "include"

# Every process of the pipeline (a flow step, the training process, a test worker) imports this package first. At
# exit, the interpreter's own garbage collections walk every object still alive: with torch, transformers, TRL and
# MLflow imported, 1.7 of a process's 6.6 CPU s (grpo_steps.training.callbacks alone) and 4.5 of 13.5 (the
# trainer), on this project's 2-core box, 2026-12-07. Frozen at exit (atexit runs this after the handlers registered
# later: the libraries' own), they are left to the OS like the rest of the process's memory; objects are still
# released by reference count, only cycles the exit would have collected are not.
atexit.register(gc.freeze)


class _TransformersWithoutSklearn:
    """Answers ``transformers.utils.is_sklearn_available()`` with False in the processes of the pipeline (installed
    below, before any of them imports transformers). transformers 5.19's ``generation/candidate_generator.py``, imported
    with every tokenizer or model it loads, imports ``sklearn.metrics`` at its top whenever scikit-learn is installed
    (it is: MLflow requires it) for one function of assisted generation's confidence threshold, which the pipeline never
    uses; scikit-learn pulls in scipy.stats and pandas: 4 of the 11 CPU s of loading a tokenizer in a flow step, on the
    2-core box (2026-12-07). A meta path finder, so a process that never imports transformers pays nothing for it."""

    @staticmethod
    def find_spec(name, path, target=None):
        if name != "transformers.utils":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            module.is_sklearn_available = lambda: False  # read by candidate_generator's `from ..utils import`

        spec.loader.exec_module = exec_module
        return spec


if _TransformersWithoutSklearn not in sys.meta_path:
    sys.meta_path.insert(0, _TransformersWithoutSklearn)
