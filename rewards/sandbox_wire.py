"""Plain-data codec between the code sandbox's judge and candidate processes (:mod:`rewards.sandbox`).

Values cross as JSON: ``None``, bools, ints, floats (NaN and infinities included), strings and lists as
themselves; tuples, dicts, sets, frozensets, bytes and complex numbers as tagged objects
``{"__t": kind, "v": ...}``; a reference to one of the candidate's top-level functions as
``{"__t": "ref", "v": name}``. :func:`decode` builds builtin objects only, so a value a hostile program
returns cannot carry behaviour (no ``__eq__`` of its own) into the judge. This module is also sent, as
source, to the candidate and judge processes, which cannot import the project: it imports nothing at module level
(:func:`cap_processes`, the sandbox's process cap, lives here for the same reason).

>>> import json
>>> decode(json.loads(json.dumps(encode((1, [2.5, "x"], {3: None}, {4}, b"\\x00")))))
(1, [2.5, 'x'], {3: None}, {4}, b'\\x00')
"""

_TAGGED = {tuple: "tuple", dict: "dict", set: "set", frozenset: "frozenset", bytes: "bytes", complex: "complex"}


def encode(value, ref_name=None):
    """``value`` as JSON-ready plain data; ``ref_name(value)`` names a function to pass by reference (or None).

    Raises:
        TypeError: a type other than the ones above (generators, instances of user classes, functions
            without a ``ref_name``).
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, ref_name) for v in value]
    if kind is dict:
        return {"__t": "dict", "v": [[encode(k, ref_name), encode(v, ref_name)] for k, v in value.items()]}
    if kind in (tuple, set, frozenset):
        return {"__t": _TAGGED[kind], "v": [encode(v, ref_name) for v in value]}
    if kind is bytes:
        return {"__t": "bytes", "v": value.hex()}
    if kind is complex:
        return {"__t": "complex", "v": [value.real, value.imag]}
    name = ref_name(value) if ref_name is not None else None
    if name is not None:
        return {"__t": "ref", "v": name}
    raise TypeError(f"a value of type {kind.__name__} cannot cross the sandbox boundary (plain data only)")


def decode(data, resolve=None):
    """The builtin value of :func:`encode`'s output; ``resolve(name)`` turns a ``ref`` into a function.

    Raises:
        ValueError: unknown tag, or a ``ref`` without ``resolve``.
        TypeError: an unhashable set element or dict key.
    """
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v, resolve) for v in data]
    if kind is not dict:
        raise ValueError(f"not sandbox wire data: {kind.__name__}")
    tag, items = data.get("__t"), data.get("v")
    if tag == "dict":
        return {decode(k, resolve): decode(v, resolve) for k, v in items}
    if tag in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(v, resolve) for v in items)
    if tag == "bytes":
        return bytes.fromhex(items)
    if tag == "complex":
        return complex(float(items[0]), float(items[1]))
    if tag == "ref" and resolve is not None:
        return resolve(str(items))
    raise ValueError(f"unknown sandbox wire tag {tag!r}")


def cap_processes(nproc):
    """``RLIMIT_NPROC`` of this process and its children: counted per user namespace under bubblewrap (this
    sandbox's processes only), so the parent leaves it open and the sandbox closes it here."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    cap = nproc if hard == resource.RLIM_INFINITY else min(nproc, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
