"""Reward functions in TRL's contract and the name registry the config refers to.

A config names a reward either by its registered name (``answer_accuracy``) or by a dotted path to
a function in the user's own importable module (``my_pkg.my_rewards:score`` or
``my_pkg.my_rewards.score``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rewards.answers import answer_accuracy, answer_format

METAFLOW_PACKAGE_POLICY = "include"

REGISTRY: dict[str, Callable[..., list[float | None]]] = {
    "answer_accuracy": answer_accuracy,
    "answer_format": answer_format,
}


class UnknownRewardError(ValueError):
    """A reward name that is neither registered nor an importable ``module:function`` path."""


def resolve_reward(name: str) -> Callable[..., list[float | None]]:
    """The reward function a config names.

    Raises:
        UnknownRewardError: the name is not registered and does not import as a callable.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    hint = f"known rewards: {', '.join(sorted(REGISTRY))}; or give a dotted path 'package.module:function'"
    if not sep or not module_name:
        raise UnknownRewardError(f"unknown reward {name!r}; {hint}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UnknownRewardError(f"unknown reward {name!r} ({err}); {hint}") from None
    if not callable(fn):
        raise UnknownRewardError(f"reward {name!r} is not callable; {hint}")
    return fn
