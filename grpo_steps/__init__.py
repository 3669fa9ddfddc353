"""GRPO pipeline: one module per concern on the flow side (config, sources, data, models, evaluate,
report, register, tracking, checkpoints, launch, lora, monitor, processes, deploy); ``steps`` holds the step bodies
the flow calls; ``weights`` the weight path's files, S3 chain, labels and server flags; ``servers`` the generation
server and its client; ``training`` what runs in the training process
(reached from the flow side only through ``training.job``)."""

import atexit
import gc

METAFLOW_PACKAGE_POLICY = "include"

# Every process of the pipeline (a flow step, the training process, a test worker) imports this package first. At
# exit, the interpreter's own garbage collections walk every object still alive: with torch, transformers, TRL and
# MLflow imported, 1.7 of a process's 6.6 CPU s (grpo_steps.training.callbacks alone) and 4.5 of 13.5 (the
# trainer), on this project's 2-core box, 2026-12-07. Frozen at exit (atexit runs this after the handlers registered
# later: the libraries' own), they are left to the OS like the rest of the process's memory; objects are still
# released by reference count, only cycles the exit would have collected are not.
atexit.register(gc.freeze)
