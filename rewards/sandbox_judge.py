"""The trusted side of the code sandbox (:mod:`rewards.sandbox`): runs a row's unit tests against the candidate's
functions, called through the candidate process, and writes the verdict. Run as ``python -I -B -c`` with
:mod:`rewards.sandbox_wire` inlined in place of its import; never imported by the pipeline.

Input on stdin: ``{"code", "prelude", "test", "entry_point", "to_candidate", "from_candidate", "started",
"max_reply_bytes", "violation_exit", "memory_exit", "nproc"}``. Once the candidate says it is up (``{"up": true}``,
before any code of the row or the program), one byte goes to descriptor ``started`` and it is closed: the parent's
wall clock for the run starts there, not at the launch of the two sandboxes (their start-up depends on the host's
load). The tests' namespace holds the row's ``prelude`` (the prompt's code:
HumanEval's helpers such as ``poly`` or ``encode_cyclic``, run here), the test's own names and, of the program,
the entry point alone, as a proxy: a program that defines ``range``, ``abs``, ``poly`` or ``check`` changes
nothing the tests call. Every call sends plain data and gets plain data back (:mod:`rewards.sandbox_wire`), and
the tests compare in this process, which the program cannot reach.
Output: one JSON line ``{"status": "passed" | "failed" | "crashed", "detail"}`` on the stdout this process was
started with (``crashed``: the candidate process ended or broke the protocol).
"""

import builtins
import json
import os
import sys

# the sandbox inlines the module in place of the next line
from rewards.sandbox_wire import cap_processes, decode, encode


def main():
    """Run the protocol above until the end (never returns: ends the process)."""
    _verdict = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the tests' prints go to stderr
    _job = json.loads(sys.stdin.read())
    cap_processes(_job["nproc"])
    _tx = os.fdopen(_job["to_candidate"], "w", encoding="utf-8")
    _rx = os.fdopen(_job["from_candidate"], "r", encoding="utf-8")


    class CandidateGone(Exception):
        """The candidate process ended, or answered with something that is not the protocol."""


    def _finish(status, detail=""):
        _verdict.write(json.dumps({"status": status, "detail": str(detail)[:1000]}) + "\n")
        _verdict.flush()
        os._exit(0)


    def _exchange(message):
        try:
            _tx.write(json.dumps(message) + "\n")
            _tx.flush()
        except (BrokenPipeError, OSError) as err:
            raise CandidateGone(f"candidate gone: {err}") from None
        line = _rx.readline(_job["max_reply_bytes"])
        if not line.endswith("\n"):
            raise CandidateGone("candidate ended" if not line else "candidate reply too long or unterminated")
        try:
            return json.loads(line)
        except ValueError as err:
            raise CandidateGone(f"candidate reply is not JSON: {err}") from None


    class Remote:
        """A top-level function of the candidate's program, called across the process boundary."""

        def __init__(self, name):
            self.name = name

        def __call__(self, *args, **kwargs):
            def ref(value):
                return value.name if isinstance(value, Remote) else None

            reply = _exchange({"op": "call", "name": self.name, "args": encode(list(args), ref),
                               "kwargs": encode(kwargs, ref)})
            if "error" in reply:
                kind = getattr(builtins, str(reply["error"]), None)
                kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
                raise kind(f"{reply['error']} in the candidate: {reply.get('message', '')}")
            try:
                return decode(reply["value"])
            except (KeyError, TypeError, ValueError) as err:
                raise CandidateGone(f"candidate reply is not plain data: {err}") from None

        def __repr__(self):
            return f"<candidate function {self.name}>"


    try:
        _tx.write(json.dumps({key: _job[key] for key in ("code", "prelude", "violation_exit", "memory_exit",
                                                          "nproc")}) + "\n")
        _tx.flush()
        _up = _rx.readline(_job["max_reply_bytes"])
    except OSError as err:
        _up = f"{err}"
    try:
        os.write(_job["started"], b"s")
        os.close(_job["started"])
    except OSError:
        pass  # the parent is gone: this process is killed with the run
    if _up != '{"up": true}\n':
        _finish("crashed", f"the candidate did not start: {_up[:200]!r}")
    try:
        _line = _rx.readline(_job["max_reply_bytes"])
        _hello = json.loads(_line) if _line.endswith("\n") else {"gone": True}
    except (OSError, ValueError) as err:
        _finish("crashed", err)
    if "load_error" in _hello:
        _finish("failed", _hello["load_error"])
    if not isinstance(_hello.get("names"), list):
        _finish("crashed", "the candidate did not load")
    _entry = _job["entry_point"]
    if _entry is not None and _entry not in _hello["names"]:
        _finish("failed", f"the program defines no function {_entry!r}")
    _namespace = {"__name__": "__main__"}
    try:
        # the row's own helpers, never the program's: a program's ``poly`` cannot stand in for the prompt's
        exec(compile(_job["prelude"] or "", "<prelude>", "exec"), _namespace)
    except BaseException as err:  # noqa: BLE001 - the row's code is broken: no verdict on the program
        _finish("crashed", f"the row's prelude (prompt code) fails: {type(err).__name__}: {err}")
    try:
        if _entry is not None:
            _candidate = Remote(str(_entry))
            _namespace[_entry] = _candidate  # the one name of the program the tests see (HumanEval/33 calls it)
        exec(compile(_job["test"], "<test>", "exec"), _namespace)
        if _entry is not None:
            _namespace["check"](_candidate)
    except CandidateGone as err:
        _finish("crashed", err)
    except BaseException as err:  # noqa: BLE001 - a failing test, whatever it raised
        _finish("failed", f"{type(err).__name__}: {err}")
    try:
        _tx.write(json.dumps({"op": "exit"}) + "\n")
        _tx.flush()
    except OSError:
        pass  # the candidate already ended: the tests had passed
    _finish("passed")


if __name__ == "__main__":
    main()
