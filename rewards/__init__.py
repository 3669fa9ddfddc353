"""Reward functions in TRL's contract and the name registry the config refers to.

A config names a reward either by its registered name (``answer_accuracy``) or by a dotted path to
a function in the user's own module (``my_rewards:score`` or ``my_pkg.my_rewards.score``), found beside the config
file, in the working directory or in the installed packages (:mod:`rewards.locate`), with keyword ``options``
bound to it and a per-call ``timeout_s``.
:func:`build_reward` turns such a spec into the callable that BOTH training (``grpo_steps.training``) and
evaluation (``grpo_steps.evaluation.scoring.score``) call, so the training reward and the eval metric are the same code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rewards.answers import answer_accuracy, answer_format
from rewards.code import code_execution
from rewards.format import think_answer_format
from rewards.game import game_invalid_moves, game_solved
from rewards.guard import guarded
from rewards.length import soft_overlong_punishment
from rewards.locate import import_attr
from rewards.math import math_accuracy
from rewards.reward_model import reward_model

METAFLOW_PACKAGE_POLICY = "include"

REGISTRY: dict[str, Callable[..., list[float | None]]] = {
    "answer_accuracy": answer_accuracy,
    "answer_format": answer_format,
    "math_accuracy": math_accuracy,
    "think_answer_format": think_answer_format,
    "soft_overlong_punishment": soft_overlong_punishment,
    "code_execution": code_execution,
    "reward_model": reward_model,
    "game_solved": game_solved,
    "game_invalid_moves": game_invalid_moves,
}

# Arguments the trainer or the evaluation passes to every reward: never configurable options.
_CALL_ARGS = {"completions", "prompts", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}


class UnknownRewardError(ValueError):
    """A reward name that is neither registered nor an importable ``module:function`` path."""


def resolve_reward(name: str) -> Callable[..., list[float | None]]:
    """The reward function a config names.

    Raises:
        UnknownRewardError: the name is not registered and does not import as a callable, or its module does not
            compile (the message names the file and line).
    """
    if name in REGISTRY:
        return REGISTRY[name]
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    hint = (f"known rewards: {', '.join(sorted(REGISTRY))}; or give a dotted path 'module:function' (a module "
            "beside the config file, in the working directory or installed)")
    if not sep or not module_name:
        raise UnknownRewardError(f"unknown reward {name!r}; {hint}")
    try:
        fn = import_attr(name)  # the config's directory, the working directory, then the installed packages
    except (ImportError, AttributeError) as err:
        raise UnknownRewardError(f"unknown reward {name!r} ({err}); {hint}") from None
    except SyntaxError as err:  # the user's module does not compile: say where, not a traceback through the CLI
        line = f": {err.text.strip()!r}" if err.text else ""
        raise UnknownRewardError(f"reward {name!r}: its module does not compile, {type(err).__name__} at "
                                 f"{err.filename}:{err.lineno}{line} ({err.msg}). Fix that line (python -m "
                                 f"py_compile {err.filename} checks the file)") from None
    if not callable(fn):
        raise UnknownRewardError(f"reward {name!r} is not callable; {hint}")
    return fn


class RewardSpecLike(Protocol):
    """What :func:`build_reward` reads from a config's reward entry (``grpo_steps.config.RewardSpec``)."""

    name: str
    options: Mapping[str, Any]
    timeout_s: float


def bind_options(fn: Callable[..., list], options: Mapping[str, Any], name: str = "") -> Callable[..., list]:
    """``fn`` with ``options`` bound as keyword arguments (``functools.partial``), checked by signature.

    Raises:
        UnknownRewardError: an option ``fn`` has no keyword parameter for, one that names a per-call
            argument (``completions``, ``completion_ids``, ...), or a required keyword-only parameter left unset.

    >>> bind_options(soft_overlong_punishment, {"max_completion_len": 8, "soft_punish_cache": 4})(
    ...     ["a", "b"], completion_ids=[[1] * 6, [1] * 9])
    [-0.5, -1.0]
    """
    params = inspect.signature(fn).parameters
    settable = {p.name for p in params.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in _CALL_ARGS}
    label = name or getattr(fn, "__name__", repr(fn))
    unknown = sorted(set(options) - settable)
    if unknown:
        raise UnknownRewardError(f"reward {label!r}: unknown options {unknown}; "
                                 f"it accepts {sorted(settable) or 'no options'}")
    missing = sorted(p.name for p in params.values()
                     if p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name not in options)
    if missing:
        raise UnknownRewardError(f"reward {label!r}: set options {missing} (required)")
    return functools.partial(fn, **options) if options else fn


def check_signature(fn: Callable[..., list], name: str, columns: set[str] | None = None) -> None:
    """Check that ``fn`` can be called as a reward: ``fn(completions, **kwargs)``.

    The guard passes the completions as the first positional argument; TRL and the evaluation pass
    ``prompts``, ``completion_ids``, ``trainer_state``, ``log_metric``, ... and every dataset column as
    keyword arguments, so ``fn`` needs a ``**kwargs``. With ``columns`` (the prepared rows' columns), a
    parameter without a default must be one of them or of those call arguments.

    Raises:
        UnknownRewardError: the signature cannot take that call; the message names the reward and the fix.

    >>> check_signature(answer_format, "answer_format")
    >>> check_signature(lambda text: [1.0], "mine")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewards.UnknownRewardError: reward 'mine' has the signature (text); a reward must take (completions, **kwargs): ...
    """
    params = list(inspect.signature(fn).parameters.values())
    signature = f"({', '.join(str(p) for p in params)})"
    fix = f"reward {name!r} has the signature {signature}; a reward must take (completions, **kwargs)"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise UnknownRewardError(f"{fix}: it has no positional parameter for the completions")
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        raise UnknownRewardError(f"{fix}: add a var-keyword parameter such as **kwargs (TRL passes the prompts, "
                                 "completion_ids and every dataset column by keyword)")
    rest = positional[1:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
    only_positional = [p.name for p in rest if p.kind == p.POSITIONAL_ONLY]
    if only_positional:
        raise UnknownRewardError(f"{fix}: {only_positional} are positional-only, but columns come by keyword")
    if columns is not None:
        missing = [p.name for p in rest if p.default is p.empty and p.name not in columns | _CALL_ARGS]
        if missing:
            raise UnknownRewardError(f"{fix}: it requires {missing}, which no prepared row has (columns: "
                                     f"{sorted(columns)}); keep them with data.columns or give them defaults")


def build_reward(spec: RewardSpecLike) -> Callable[..., list[float | None]]:
    """The callable for a config's reward entry: resolved, options bound, guarded; ``__name__ == spec.name``.

    Used by training and by evaluation alike. Never raises at call time: a call that fails or exceeds
    ``spec.timeout_s`` seconds returns None per completion and is counted (:mod:`rewards.guard`).

    Raises:
        UnknownRewardError: as :func:`resolve_reward`, :func:`bind_options` and :func:`check_signature`.
    """
    fn = bind_options(resolve_reward(spec.name), spec.options, spec.name)
    check_signature(fn, spec.name)
    return guarded(fn, spec.name, spec.timeout_s)
