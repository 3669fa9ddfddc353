"""The curriculum's picture: the pass rates of the groups each optimizer step trained, as a heat map (x: step,
y: pass-rate bin, colour: groups), saved beside the run's checkpoints and logged to its MLflow run."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_steps.training.curriculum.state import HISTOGRAM_BINS

ARTIFACT_DIR = "curriculum"
"""Where the picture goes in the MLflow run's artifacts (``curriculum/pass_rate.png``)."""
PICTURE = "pass_rate.png"


def pass_rate_heatmap(history: dict[int, list[int]], path: str | os.PathLike) -> Path:
    """Draw ``history`` (optimizer step -> :data:`HISTOGRAM_BINS` group counts, pass rate 0 to 1) into the PNG
    ``path``; steps without groups stay blank. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    steps = sorted(history)
    grid = np.full((HISTOGRAM_BINS, steps[-1] - steps[0] + 1), np.nan)  # (bins, steps)
    for step in steps:
        counts = np.asarray(history[step], dtype=float)
        grid[:, step - steps[0]] = counts / max(counts.sum(), 1.0)  # share of the step's groups per bin
    figure, axes = plt.subplots(figsize=(max(6.0, 0.25 * grid.shape[1] + 2), 3.5))
    image = axes.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1,
                        extent=(steps[0] - 0.5, steps[-1] + 0.5, 0, 1))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("group pass rate")
    axes.set_title("Pass rates of the trained groups")
    axes.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps are whole numbers
    figure.colorbar(image, ax=axes, label="share of the step's groups")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def log_heatmap(history: dict[int, list[int]], output_dir: str | os.PathLike, run_id: str | None,
                tracking_uri: str | None) -> Path:
    """Draw the heat map into ``output_dir/curriculum_pass_rate.png`` and, with ``run_id``, log it to that MLflow run
    under :data:`ARTIFACT_DIR`. Training is over when this runs: a tracking server that fails is reported on stderr
    (the picture stays on disk), not raised."""
    path = pass_rate_heatmap(history, Path(output_dir) / f"curriculum_{PICTURE}")
    if run_id is None:
        return path
    import shutil
    import sys
    import tempfile

    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory() as directory:
        named = shutil.copy(path, Path(directory) / PICTURE)
        try:
            MlflowClient(tracking_uri).log_artifact(run_id, named, ARTIFACT_DIR)
        except Exception as err:  # the trained policy matters more than its picture; the failure is shown
            print(f"[curriculum] the pass-rate picture was not logged to MLflow run {run_id}: {err!r} (kept at "
                  f"{path})", file=sys.stderr, flush=True)
    return path
