"""Where the module of a dotted path (a reward, tool or environment the config names) is found.

A config names its own code as ``module:function`` (or ``package.module.function``). The module is looked up in a
documented order: the config file's directory, then the working directory the run was started from, then the
installed packages (``grpo_steps.config``'s ``module_dirs``, filled in when the config file is read). The standard
library and the installed packages stay first, so a ``json.py`` or ``datasets.py`` beside a config cannot shadow them.

:func:`add_module_dirs` puts those directories on ``sys.path`` of this process, after the installed packages;
every process that validates the config does so (the flow's steps, the training job, the evaluation), and a tool's
worker process is started with the same directories (:func:`grpo_steps.tools.worker.worker_command`).
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

_ADDED: list[str] = []
"""The directories :func:`add_module_dirs` put on ``sys.path`` here, in order."""


def add_module_dirs(dirs: list[str]) -> None:
    """Put ``dirs`` (absolute paths) on ``sys.path``, in their order, after everything already there (the standard
    library and the installed packages): a user module found by name resolves as before, but a file beside the config
    or in the working directory named like an installed package (``datasets.py``, ``requests.py``) no longer replaces
    that package in every main process. A directory already on ``sys.path`` stays where it is (the flow script's own,
    put first by Python). Directories that do not exist here (a config read on another machine: a cluster step imports
    from Metaflow's code package instead) are harmless."""
    for directory in dirs:
        if directory in _ADDED:
            continue
        if directory not in sys.path:
            sys.path.append(directory)  # after the directories added before: the config's first, then the working one
        _ADDED.append(directory)
    importlib.invalidate_caches()


def module_dirs() -> list[str]:
    """The directories :func:`add_module_dirs` added in this process, in search order."""
    return list(_ADDED)


def import_attr(path: str) -> object:
    """The object a ``module:name`` or ``module.name`` path names.

    Raises:
        ValueError: ``path`` has no module part.
        ImportError, AttributeError: as ``importlib.import_module`` / ``getattr``; an ImportError names the
            directories searched besides the installed packages.
    """
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"{path!r} is not a dotted path 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):  # the module itself, not one it imports
            searched = ", ".join(_ADDED) or "no directory"
            raise ModuleNotFoundError(f"No module named {err.name!r} in {searched} or the installed packages",
                                      name=err.name) from None
        raise
    return getattr(module, attr)


def module_file(module: ModuleType) -> Path | None:
    """The file or package directory that ships ``module``: its top-level package's directory, or the file of a
    single-file module; None for a built-in or namespace module."""
    top = sys.modules.get(module.__name__.split(".")[0], module)
    file = getattr(top, "__file__", None)
    if not file:
        return None
    file = Path(file).resolve()
    return file.parent if file.name == "__init__.py" else file


def top_file(module_name: str) -> Path | None:
    """:func:`module_file` of the module ``module_name``, imported or not (an unimported one is located by
    ``importlib.util.find_spec``, without running it); None for a built-in or namespace module, or one not found."""
    if module_name in sys.modules:
        return module_file(sys.modules[module_name])
    import importlib.util

    spec = importlib.util.find_spec(module_name.split(".")[0])
    if spec is None or not spec.has_location or not spec.origin:
        return None
    file = Path(spec.origin).resolve()
    return file.parent if file.name == "__init__.py" else file


def origin(module_name: str) -> str:
    """Where the top-level module of ``module_name`` (imported or not) is found: ``"module_dirs"`` (a directory of
    :func:`module_dirs`: user code, shipped with the run), ``"installed"`` (site-packages or the standard library:
    the image must hold it), ``"elsewhere"`` (another ``sys.path`` entry, e.g. ``PYTHONPATH``: nothing ships it), or
    ``"builtin"`` (also: not found)."""
    found = top_file(module_name)
    if found is None:
        return "builtin"
    # installed first: a virtualenv inside the working directory (`make`'s .venv, a run started from the checkout)
    # holds site-packages under a module_dirs entry, and its packages are the image's, not the run's to ship
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        if found.is_relative_to(Path(sysconfig.get_path(key)).resolve()):
            return "installed"
    for directory in _ADDED:
        if found.is_relative_to(Path(directory).resolve()):
            return "module_dirs"
    return "elsewhere"
