"""The untrusted side of the code sandbox (:mod:`rewards.sandbox`): runs a completion's program and answers the
judge's calls to its functions. Sent as source to ``python -I -S -B -c`` in the contained process, with
:mod:`rewards.sandbox_wire` inlined in place of its import; never imported by the pipeline.

Protocol (one JSON object per line): the judge sends ``{"code", "prelude", "violation_exit", "memory_exit",
"nproc"}`` on stdin; this process answers ``{"up": true}`` (its start-up is over), runs the prelude (the prompt's
code), then the code, and answers ``{"names": [top-level callables]}`` (or ``{"load_error": "..."}``), then for each
``{"op": "call", "name",
"args", "kwargs"}`` ``{"value": wire}`` or ``{"error": type, "message"}``,
until ``{"op": "exit"}`` or end of input. Nothing this process writes decides a verdict: the judge compares.
The program's own stdout goes to stderr; the protocol's pipes are private duplicates.
"""

import json
import os
import sys

# the sandbox inlines the module in place of the next line (no project on sys.path)
from rewards.sandbox_wire import cap_processes, decode, encode


def main():
    """Run the protocol above until the end (never returns: ends the process)."""
    _rx = os.fdopen(os.dup(0), "r", encoding="utf-8")
    _tx = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the program reads nothing of the protocol
    os.dup2(2, 1)  # and its prints cannot mix into it
    _job = json.loads(_rx.readline())
    cap_processes(_job["nproc"])


    def _send(message):
        _tx.write(json.dumps(message) + "\n")
        _tx.flush()


    _root = os.path.realpath(os.getcwd()) + os.sep
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    _DENY = frozenset((
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
        "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
        "ctypes.dlopen", "ctypes.dlsym", "os.kill", "os.killpg", "signal.pthread_kill", "os.setuid", "os.chroot",
        "sys.addaudithook"))
    _PATHS = frozenset((
        "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
        "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"))


    def _make_hook(root, deny, paths, write_flags, code, _exit=os._exit, _write=os.write, _realpath=os.path.realpath,
                   _fsdecode=os.fsdecode):
        """A PEP 578 audit hook: defence in depth only (the layers outside the process contain the program, and the
        verdict is the judge's). Its state lives in a closure, and a ``dir_fd`` argument (a path relative to a
        directory descriptor the hook cannot resolve) counts as outside."""

        def inside(path, dir_fd=None):
            if dir_fd is not None or isinstance(path, int):
                return isinstance(path, int) and dir_fd is None
            try:
                path = _fsdecode(path)
            except TypeError:
                return False
            return (_realpath(path) + "/").startswith(root)

        def hook(event, args):
            bad = event in deny
            if event == "open" and len(args) >= 3:
                path, mode, flags = args[0], args[1], args[2] or 0
                writes = (flags & write_flags) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
                bad = bool(writes) and not inside(path)
            elif event in paths:
                dir_fds = [a for a in args[2:] if isinstance(a, int) and a >= 0]
                bad = bool(dir_fds) or not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))
            if bad:
                _write(2, ("sandbox: blocked " + event + "\n").encode())
                _exit(code)

        return hook


    sys.addaudithook(_make_hook(_root, _DENY, _PATHS, _WRITE, _job["violation_exit"]))
    del _make_hook
    _send({"up": True})  # before any of the row's or the program's code: the run's wall clock starts here
    _namespace = {"__name__": "__main__"}
    try:
        # the prompt's code first (HumanEval's helpers and imports, as its own harness runs prompt + completion)
        exec(compile(_job.pop("prelude") or "", "<prelude>", "exec"), _namespace)
        exec(compile(_job.pop("code"), "<solution>", "exec"), _namespace)
    except MemoryError:
        os._exit(_job["memory_exit"])
    except BaseException as err:  # noqa: BLE001 - SystemExit and errors alike: the program did not load
        _send({"load_error": f"{type(err).__name__}: {err}"[:500]})
        sys.stderr.flush()
        os._exit(0)
    _send({"names": sorted(n for n, v in _namespace.items() if callable(v) and not n.startswith("__"))})


    def _ref_name(value):
        for name, candidate in _namespace.items():
            if candidate is value:
                return name
        return None


    for _line in _rx:
        _request = json.loads(_line)
        if _request.get("op") != "call":
            break
        try:
            _args = decode(_request["args"], _namespace.__getitem__)
            _kwargs = decode(_request["kwargs"], _namespace.__getitem__)
            _reply = {"value": encode(_namespace[_request["name"]](*_args, **_kwargs), _ref_name)}
        except MemoryError:
            os._exit(_job["memory_exit"])
        except BaseException as err:  # noqa: BLE001 - any failure of the program's function is the judge's to weigh
            _reply = {"error": type(err).__name__, "message": str(err)[:500]}
        _send(_reply)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
