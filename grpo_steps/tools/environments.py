"""The environments of ``environment:`` (TRL's ``environment_factory``), each instance in a worker process.

An environment is a factory (a class, usually) whose instances have ``reset(**row) -> str | None`` (the string is
appended to the last user message), public methods that are its tools, and optionally ``get_reward() -> float``;
TRL's ``GRPOTrainer`` keeps one instance per rollout. :func:`environment_factories` resolves the configured ones
(a game behind an adapter prefix through :mod:`grpo_steps.tools.games`), probes each once in this process for its
tools' schemas, and returns factories whose instances run elsewhere.

**The process.** Every environment instance lives in a worker process of its own (:class:`EnvironmentProcess`),
forked from a server that imported the environment's module once (``multiprocessing``'s ``forkserver``: TextArena's
import takes ~3 s, a fork ~10 ms). The instance's state lives there for the whole episode; each method call crosses
a pipe and is limited to ``generation.tool_timeout_s``. A call over its limit kills the worker (its process group:
whatever the environment started) and ends the episode, scored failed: the state of a killed process is gone, and
the next ``reset`` starts a fresh worker. The episode as a whole is limited to ``generation.episode_timeout_s`` of
wall clock from its ``reset``: a move or a ``get_reward`` past it ends the episode, scored failed, and
``outcome["timed_out"]`` counts it. With ``generation.async`` an episode may be reset ahead, before the trainer
reaches its batch (``ProcessEnvironment._reset_ahead``, :mod:`grpo_steps.training.generation.episodes_ahead`); its
clock then starts when the trainer takes it.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from grpo_steps.tools.functions import (
    DEFAULT_MAX_TOOL_RESPONSE,
    ToolError,
    check_tool,
    resolve_callable,
    tool_functions,
)
from grpo_steps.tools.games import adapter_factory, module_of
from grpo_steps.tools.worker import cut_response

_CONTEXT = multiprocessing.get_context("forkserver")
_PRELOAD = ["rewards.locate", __name__]
"""Modules the fork server imports once (each environment's module joins while the server is not running yet)."""
_MAIN_PATH = "GRPO_ENVIRONMENT_MAIN_PATH"
"""Where the parent's ``__main__`` script is, for the fork server (see :func:`_adopt_main`)."""


def _adopt_main() -> None:
    """In the fork server: name the parent's main script as this process's ``__main__`` file. multiprocessing's
    spawn preparation runs the parent's main script again in every worker (a Metaflow step's flow file: Metaflow's
    import, ~1 s each) unless the worker's ``__main__`` is that file already (``spawn._fixup_main_from_path``); the
    workers need nothing of it (a ``-m`` main, the trainer's or pytest's, is skipped by multiprocessing itself)."""
    main = sys.modules.get("__main__")
    path = os.environ.get(_MAIN_PATH)
    if path and main is not None and getattr(main, "__file__", None) is None:
        main.__file__ = path


_adopt_main()
_PROCESSES: weakref.WeakSet = weakref.WeakSet()
"""Every :class:`EnvironmentProcess` with a worker, killed at interpreter exit (no orphan worker)."""


def _host(spec: str, dirs: list[str], conn) -> None:
    """The worker's loop: build the environment, then answer ``(method, args, kwargs)`` requests with
    ``("value", v)`` or ``("error", "Type: message")`` until the pipe closes."""
    os.setsid()  # a group of its own: a kill takes whatever the environment started too
    from rewards.locate import add_module_dirs, import_attr

    add_module_dirs(dirs)
    instance = adapter_factory(spec, lambda path, key: import_attr(path), "environment")()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            target = getattr(instance, method)
            value = target(*args, **kwargs) if callable(target) else target
        except BaseException as err:  # noqa: BLE001 - SystemExit too: the call's error, sent back
            conn.send(("error", f"{type(err).__name__}: {err}"[:2000]))
        else:
            conn.send(("value", value))


START_TIMEOUT_S = 120.0
"""Seconds a worker may take to start and build its environment (added to the first call's limit)."""


class EnvironmentProcess:
    """One environment instance (``spec``, as ``environment:`` names it) in a worker process, started at the first
    call. :meth:`call` raises ``TimeoutError`` past its limit (the worker is killed), ``RuntimeError`` for what the
    method raised or a worker that ended; :meth:`close` kills the worker (also at interpreter exit)."""

    def __init__(self, spec: str) -> None:
        from rewards.locate import module_dirs

        self.spec, self.dirs = spec, module_dirs()
        self.proc = self.conn = None
        _PROCESSES.add(self)

    def call(self, method: str, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
        if self.proc is None:
            timeout_s += START_TIMEOUT_S
            self.conn, child = _CONTEXT.Pipe()
            self.proc = _CONTEXT.Process(target=_host, args=(self.spec, self.dirs, child), daemon=True,
                                         name=f"environment-{self.spec}")
            self.proc.start()
            child.close()
        try:
            self.conn.send((method, args, kwargs))
            # the first call also waits for the worker's start (an import of the environment's module at most)
            ready = self.conn.poll(timeout_s)
        except (BrokenPipeError, EOFError, OSError):
            ready = True
        if not ready:
            self.close()
            raise TimeoutError(f"environment {self.spec!r}: {method} took longer than {timeout_s:g} s; its process "
                               "was killed and the episode ended")
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"environment {self.spec!r} ended its process (exit code {code})") from None
        if kind == "error":
            raise RuntimeError(f"environment {self.spec!r}: {method} raised {value}")
        return value

    def close(self) -> None:
        """Kill the worker and its process group (nothing when none runs)."""
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()  # before its setsid: not a group leader yet
        proc.join()
        conn.close()

    def __del__(self) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for process in list(_PROCESSES):
        process.close()


class ProcessEnvironment:
    """The trainer's side of one environment instance: ``reset``, the tools and ``get_reward`` forwarded to its
    :class:`EnvironmentProcess`, each call limited to the smaller of the tool limit and what is left of the episode's
    wall clock. Built per ``environment:`` entry by :func:`process_factory` (subclassed with the environment's tool
    methods, named as its class, as TRL looks them up on the class)."""

    _spec: str = ""
    _timeout_s: float = 10.0
    _episode_s: float | None = None
    _max_chars: int = 4096

    def __init__(self) -> None:
        self._process = EnvironmentProcess(self._spec)
        self._started = time.monotonic()
        self._ended: str | None = None
        self._timed_out = False
        self._ahead: tuple[dict, Any] | None = None  # (row, observation) of a reset made ahead (_reset_ahead)

    def reset(self, **row: Any) -> str | None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and _same_row(ahead[0], row):
            # reset ahead for this very row (generation.async): the episode is the one whose observation the
            # producer's first prompt holds; its clock starts now, when the trainer plays it (not while queued)
            self._started = time.monotonic()
            return ahead[1]
        self._ended, self._timed_out = None, False
        observation = self._process.call("reset", self._timeout_s, **row)
        self._started = time.monotonic()  # after the reset: a worker's start is not the episode's time
        return observation

    def _reset_ahead(self, **row: Any) -> str | None:  # private: TRL would expose a public method as a tool
        """``reset(**row)`` now, for a generation batch the trainer reaches later (``generation.async``: its first
        turn is sampled ahead with the observation in the prompt); the trainer's own ``reset`` with the same row then
        returns that observation and plays this episode, in this worker, without resetting it again."""
        observation = self.reset(**row)
        self._ahead = (row, observation)
        return observation

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._ended is not None:
            raise RuntimeError(f"the episode is over ({self._ended}): make no more calls")
        limit = self._timeout_s
        if self._episode_s is not None:
            left = self._episode_s - (time.monotonic() - self._started)
            if left <= 0:
                self._end(f"over its wall clock of {self._episode_s:g} s (generation.episode_timeout_s)", True)
                raise TimeoutError(f"the episode is over: {self._ended}; it is scored failed")
            limit = min(limit, left)
        try:
            value = self._process.call(method, limit, *args, **kwargs)
        except TimeoutError:
            over = limit < self._timeout_s  # the episode's clock ran out before the call's own limit
            self._end(f"over its wall clock of {self._episode_s:g} s (generation.episode_timeout_s), in a {method} "
                      "that was killed" if over else
                      f"{method} took longer than {self._timeout_s:g} s (generation.tool_timeout_s)", over)
            raise TimeoutError(f"the episode is over: {self._ended}; it is scored failed") from None
        return cut_response(value, self._max_chars)

    def _end(self, why: str, timed_out: bool) -> None:
        self._ended, self._timed_out = why, timed_out
        self._process.close()  # the state is gone with it: the episode cannot go on (a later reset starts anew)

    def _close(self) -> None:  # private: TRL would expose a public method as a tool
        self._process.close()

    @property
    def outcome(self) -> dict:
        """The game's own ``outcome`` (:mod:`grpo_steps.tools.games`; ``{}`` for an environment without one), with
        ``timed_out`` (the episode passed its wall clock) and ``ended`` (why the episode was ended early, or None); an
        episode ended early is not ``solved``."""
        game: dict = {}
        if self._ended is None:
            try:
                game = self._process.call("outcome", self._timeout_s)
            except RuntimeError as err:
                if "AttributeError" not in str(err):  # a TRL-contract environment without one
                    raise
        if not isinstance(game, dict):
            game = {}
        if self._ended is not None:
            game["solved"] = False
        return {**game, "timed_out": self._timed_out, "ended": self._ended}


def _same_row(a: dict, b: dict) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values whose == is not a bool (arrays): not provably the same row
        return False


def _forwarder(name: str, original: Callable) -> Callable:
    @functools.wraps(original)  # same name, signature and docstring: the schema the model reads is the tool's
    def forward(self: ProcessEnvironment, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    return forward


def _reward_forwarder() -> Callable:
    def get_reward(self: ProcessEnvironment) -> float:
        if self._ended is not None:
            return 0.0  # a killed or timed-out episode is scored failed
        return self._process.call("get_reward", self._timeout_s)

    return get_reward


def process_factory(spec: str, probe: Any, methods: list[str], timeout_s: float, episode_s: float | None,
                    max_chars: int) -> type:
    """A class in TRL's environment contract whose instances run environment ``spec`` in a worker process
    (:class:`ProcessEnvironment`), with ``probe``'s tools ``methods`` (names) and its ``get_reward`` when it has
    one; named as ``probe``'s class, or as the game an adapter plays (TRL logs an environment's reward under its
    class's name: ``rewards/<name>/mean``)."""
    cls = type(probe)
    members: dict[str, Any] = {name: _forwarder(name, getattr(cls, name)) for name in methods}
    if callable(getattr(probe, "get_reward", None)):
        members["get_reward"] = _reward_forwarder()
    members.update(_spec=spec, _timeout_s=timeout_s, _episode_s=episode_s, _max_chars=max_chars,
                   __doc__=cls.__doc__, __module__=__name__)
    # the environment's module imported once in the fork server, so that each worker is forked with it imported (a
    # server already running keeps its preloads: the module is then imported in each worker); a preload that fails
    # to import is skipped by multiprocessing, and the worker imports it, failing visibly
    module = module_of(spec)
    if module not in _PRELOAD:
        _PRELOAD.append(module)
    _CONTEXT.set_forkserver_preload(list(_PRELOAD))
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and getattr(sys.modules["__main__"].__spec__, "name", None) is None:
        os.environ.setdefault(_MAIN_PATH, os.path.normpath(main_file))  # read by _adopt_main in the fork server
    return type(getattr(probe, "_name", cls.__name__), (ProcessEnvironment,), members)


def environment_methods(instance: Any) -> list[str]:
    """The names of an environment's tools: its class's public functions but ``reset`` and ``get_reward``
    (TRL's rule, ``GRPOTrainer.__init__``)."""
    return [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def environment_factories(spec: str | dict[str, str] | None, timeout_s: float,
                          max_chars: int = DEFAULT_MAX_TOOL_RESPONSE,
                          episode_s: float | None = None) -> dict[str | None, Callable] | None:
    """The configured environment (``environment:``) as ``{name: factory}`` (``None`` the one name of a single
    factory); None without one. Each entry is a factory in TRL's contract, a gymnasium-style class
    (``gym:module:Class``) or a TextArena game (``textarena:<id>``), adapted by :mod:`grpo_steps.tools.games`; its
    instances run in worker processes (:func:`process_factory`): each call limited to
    ``timeout_s`` seconds and ``max_chars`` characters of answer, each episode to ``episode_s`` seconds of wall
    clock from its reset (None: no limit).

    Raises:
        ToolError: a factory that does not import, or whose instance has no ``reset`` or a tool without a
            schema.
    """
    if spec is None:
        return None
    named = {None: spec} if isinstance(spec, str) else dict(spec)
    factories = {}
    for name, path in named.items():
        key = "environment" if name is None else f"environment.{name}"
        factory = adapter_factory(path, resolve_callable, key)
        probe = factory()  # in this process, once: its class's tools and their schemas
        if not callable(getattr(probe, "reset", None)):
            raise ToolError(f"{key} {path!r}: its instances need a reset(**row) method (TRL's environment "
                              "contract), returning a string appended to the question or None; or name a "
                              "gymnasium-style class as 'gym:module:Class', a TextArena game as 'textarena:<id>'")
        methods = environment_methods(probe)
        for method in methods:
            check_tool(getattr(probe, method), f"{key} {path!r}, tool {method!r}")
        factories[name] = process_factory(path, probe, methods, timeout_s, episode_s, max_chars)
    return factories


def trl_environment_factory(factories: dict[str | None, Callable] | None):
    """What ``GRPOTrainer(environment_factory=...)`` takes: the one factory, or the ``{name: factory}`` mapping."""
    if factories is None:
        return None
    return factories[None] if None in factories else factories


def prompt_tools(paths: list[str], environment: str | dict[str, str] | None, timeout_s: float) -> list[Callable]:
    """Every tool a prompt may render: the configured tools and the methods of the environment(s), probed (with
    several environments, all of their tools: an upper bound of a prompt's length). For the token budget of data
    preparation and for evaluation's prompts."""
    tools = tool_functions(paths, timeout_s)
    for factory in (environment_factories(environment, timeout_s) or {}).values():
        instance = factory()
        tools += [getattr(instance, name) for name in environment_methods(instance)]
    return tools
