"""Weight labels, every one the pipeline makes or reads: the name a generation server reports for the weights it serves
(``/weight_info``, ``weight_versions`` spans of the token route) and the model name it serves a LoRA adapter under.

- ``step-N``: a training push of version N (the optimizer step that produced it), :func:`version_label`;
- ``eval-<label>``: the ``evaluate`` step's ``<label>`` policy (``baseline``, ``trained``), :func:`eval_label`;
- ``<served>-lora-<label>``: an adapter served beside the base weights ``<served>``, its label ``step-N`` (a push) or
  ``final`` (evaluation), :func:`adapter_name`.

Any other label (``default`` at start-up) is no weights of this run.
"""

from __future__ import annotations

STEP = "step-"
EVAL = "eval-"
LORA = "-lora-"


def version_label(version: int) -> str:
    """The server-side label of weight version ``version`` (the optimizer step that produced it)."""
    return f"{STEP}{version}"


def label_version(label: str) -> int | None:
    """The weight version a :func:`version_label` names, or None for any other label (a server's ``default``).

    >>> label_version("step-12"), label_version("default"), label_version("eval-base"), label_version("step-x")
    (12, None, None, None)
    """
    number = label.removeprefix(STEP)
    return int(number) if label.startswith(STEP) and number.isdigit() else None


def eval_label(label: str) -> str:
    """The weight label the server carries while it serves the ``evaluate`` step's ``label`` policy (``baseline``,
    ``trained``).

    >>> eval_label("trained")
    'eval-trained'
    """
    return f"{EVAL}{label}"


def adapter_name(served_model: str, version: int | str) -> str:
    """Model name the server serves the adapter of weight version ``version`` under (an int: a push, labelled
    :func:`version_label`; a string, e.g. ``final``: as given).

    >>> adapter_name("policy", 3)
    'policy-lora-step-3'
    >>> adapter_name("policy", "final")
    'policy-lora-final'
    """
    label = version_label(version) if isinstance(version, int) else version
    return f"{served_model}{LORA}{label}"

