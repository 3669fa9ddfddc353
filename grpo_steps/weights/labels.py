"""Weight version labels: the name a generation server reports for the weights it serves (``/weight_info``,
``weight_versions`` spans of the token route). A push of version N (the optimizer step that produced it) is labelled
``step-N``; any other label (``default`` at start-up, ``eval-...`` in evaluation) is no push of this run.
"""

from __future__ import annotations


def version_label(version: int) -> str:
    """The server-side label of weight version ``version`` (the optimizer step that produced it)."""
    return f"step-{version}"


def label_version(label: str) -> int | None:
    """The weight version a :func:`version_label` names, or None for any other label (a server's ``default``).

    >>> label_version("step-12"), label_version("default"), label_version("eval-base")
    (12, None, None)
    """
    prefix, _, number = label.partition("-")
    return int(number) if prefix == "step" and number.isdigit() else None
