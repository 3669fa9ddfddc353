"""A ValidatingAdmissionPolicy evaluated as the Kubernetes API server evaluates it, through a real CEL engine
(``cel-python``, pure Python; a development dependency), so the shipped policy (infra/k8s/admission.yaml) is tested
against the objects it must admit and refuse without a cluster (tests/unit/test_admission.py).

Follows Kubernetes' "Validating Admission Policy" page (kubernetes.io/docs/reference/access-authn-authz/
validating-admission-policy/, v1.30+) and the ``admissionregistration.k8s.io/v1`` API:

- ``spec.matchConstraints`` (and a binding's ``matchResources``): ``resourceRules`` / ``excludeResourceRules``
  (operations, apiGroups, apiVersions, resources, ``*``), ``namespaceSelector`` and ``objectSelector`` (label selectors:
  matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist);
- ``spec.matchConditions``: the policy applies only where every one is true; an error and none false applies
  ``failurePolicy``;
- ``spec.variables``: ``variables.<name>``, each evaluated lazily on first use and kept, seeing only the variables
  before it (as composition is documented);
- ``spec.validations``: each must evaluate to true; otherwise its ``messageExpression`` (when it gives a non-empty
  string), else its ``message``, else ``failed expression: <expression>``; an error applies ``failurePolicy``
  (``Fail``: refused, naming the error).

The expressions see ``request`` (an ``admission.k8s.io/v1`` AdmissionRequest: kind, resource, requestKind,
requestResource, name, namespace, operation, userInfo with extra, dryRun, options), ``object`` (null on DELETE),
``oldObject`` (null on CREATE), ``namespaceObject``, ``params`` (null: ``paramKind`` is refused here) and
``variables``. The objects are the JSON the API server would hold after defaulting: callers give them as such,
and a field set to null is absent (as the API server decodes it).
Kubernetes' CEL libraries that cel-python lacks are added for what policies use (:data:`KUBERNETES_FUNCTIONS`): the
extended strings library (``replace``, ``substring``, ``split``, ``join``, ``lowerAscii``, ``upperAscii``, ``trim``,
``indexOf``, ``lastIndexOf``, ``charAt``; cel-go ``ext.Strings``, as Kubernetes' CEL environment loads it). Not
provided: ``authorizer``, quantity and URL libraries, cost limits (an expression using them is an error, hence
refused under ``failurePolicy: Fail``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes

OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")


@dataclass(frozen=True)
class Decision:
    """The policy's answer to one request: ``allowed``, and the messages of the validations that refused it (empty
    when allowed). ``applied``: whether the request matched the policy and its binding (False: admitted untouched)."""

    allowed: bool
    messages: tuple[str, ...]
    applied: bool


def _string_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """A CEL function over Python strings: arguments unwrapped, a str result wrapped as a CEL string, a list as a
    CEL list of strings, an int as a CEL int; a Python error becomes a CEL evaluation error."""

    @functools.wraps(method)
    def wrapped(*args):
        try:
            value = method(*(list(map(str, a)) if isinstance(a, list) else a if isinstance(a, int) else str(a)
                             for a in args))
        except (ValueError, IndexError, TypeError) as error:
            return celpy.CELEvalError(f"{method.__name__}: {error}", type(error), error.args)
        if isinstance(value, str):
            return celtypes.StringType(value)
        if isinstance(value, list):
            return celtypes.ListType(celtypes.StringType(v) for v in value)
        return celtypes.IntType(value)

    return wrapped


def _substring(s: str, start: int, end: int | None = None) -> str:
    end = len(s) if end is None else end
    if not 0 <= start <= end <= len(s):
        raise IndexError(f"substring({start}, {end}) out of range of a string of {len(s)} characters")
    return s[start:end]


def _replace(s: str, old: str, new: str, limit: int = -1) -> str:
    return s.replace(old, new, limit)


def _split(s: str, separator: str, limit: int = -1) -> list[str]:
    # ext.Strings: limit 0 gives no element, a negative one all of them, n at most n (the last holds the rest)
    return [] if limit == 0 else s.split(separator, limit - 1 if limit > 0 else -1)


def _join(items: list[str], separator: str = "") -> str:
    return separator.join(items)


def _index_of(s: str, sub: str, start: int = 0) -> int:
    return s.find(sub, start)


def _last_index_of(s: str, sub: str, end: int | None = None) -> int:
    return s.rfind(sub, 0, len(s) if end is None else end + len(sub))


def _ascii(s: str, upper: bool) -> str:
    """``lowerAscii``/``upperAscii``: only ASCII letters change case."""
    return "".join((c.upper() if upper else c.lower()) if c.isascii() else c for c in s)


KUBERNETES_FUNCTIONS: dict[str, Callable[..., Any]] = {
    name: _string_function(function) for name, function in {
        "replace": _replace, "substring": _substring, "split": _split, "join": _join, "indexOf": _index_of,
        "lastIndexOf": _last_index_of, "lowerAscii": lambda s: _ascii(s, False),
        "upperAscii": lambda s: _ascii(s, True), "trim": str.strip,
        "charAt": lambda s, i: s[i:i + 1] if 0 <= i <= len(s) else s[i]}.items()}
"""Kubernetes' CEL string extensions (cel-go ``ext.Strings`` v2, in every Kubernetes CEL environment since 1.27)
missing from cel-python's standard functions, by the name an expression calls (``s.replace('.', '-')``)."""

_ENV = celpy.Environment()


@functools.cache
def _program(expression: str) -> celpy.Runner:
    """``expression`` compiled once (raises ``celpy.CELParseError`` on a syntax error)."""
    return _ENV.program(_ENV.compile(expression), functions=KUBERNETES_FUNCTIONS)


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    """``expression``'s value over ``activation`` (CEL values); a CEL evaluation error is returned, not raised, as
    CEL's error values are (``celpy.CELEvalError``)."""
    try:
        return _program(expression).evaluate(activation)
    except celpy.CELEvalError as error:
        return error


class _Variables(celtypes.MapType):
    """``variables``: each evaluated on first use, over the activation and the variables declared before it."""

    def __init__(self, declared: list[dict], activation: dict[str, Any]) -> None:
        super().__init__()
        self._declared, self._activation = declared, activation
        self._names = [v["name"] for v in declared]
        self._values: dict[str, Any] = {}

    def __contains__(self, key: object) -> bool:
        return str(key) in self._names

    def __getitem__(self, key: object) -> Any:
        name = str(key)
        if name not in self._names:
            raise KeyError(name)
        if name not in self._values:
            index = self._names.index(name)
            before = _Variables(self._declared[:index], self._activation)
            before._values = {k: v for k, v in self._values.items() if k in before._names}
            self._values[name] = evaluate(self._declared[index]["expression"],
                                          {**self._activation, "variables": before})
            self._values.update(before._values)
        return self._values[name]


def kind_to_resource(kind: str) -> str:
    """The plural resource of ``kind``, by Kubernetes' own guess (apimachinery ``meta.UnsafeGuessKindToResource``).

    >>> [kind_to_resource(k) for k in ("NetworkPolicy", "JobSet", "Ingress")]
    ['networkpolicies', 'jobsets', 'ingresses']
    """
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    return lower[:-1] + "ies" if lower.endswith("y") else lower + "s"


def _selects(selector: dict | None, labels: dict) -> bool:
    """A ``metav1.LabelSelector`` over ``labels`` (no selector: everything; an empty one: everything too)."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def _rule_matches(rule: dict, group: str, version: str, resource: str, operation: str) -> bool:
    def has(values: Iterable[str], value: str) -> bool:
        return "*" in values or value in values

    return (has(rule.get("operations", []), operation) and has(rule.get("apiGroups", []), group)
            and has(rule.get("apiVersions", []), version)
            and any(r in ("*", "*/*", resource) for r in rule.get("resources", [])))


def _matches(resources: dict | None, request: dict, obj: dict, namespace: dict) -> bool:
    """Whether ``resources`` (a policy's matchConstraints or a binding's matchResources) covers the request."""
    if resources is None:
        return True
    kind, resource = request["kind"], request["resource"]["resource"]
    def covered(rules):
        return any(_rule_matches(r, kind["group"], kind["version"], resource, request["operation"])
                   for r in rules or [])

    labels = [(o.get("metadata") or {}).get("labels") or {} for o in obj if o]
    return (covered(resources.get("resourceRules")) and not covered(resources.get("excludeResourceRules"))
            and _selects(resources.get("namespaceSelector"), namespace["metadata"].get("labels") or {})
            and any(_selects(resources.get("objectSelector"), ls) for ls in labels))


def _request(obj: dict, operation: str, user: str, pod_name: str | None, namespace: str) -> dict:
    """The AdmissionRequest of ``operation`` on ``obj`` by ``user``; a service account's token bound to a pod
    carries the pod's name in ``extra`` (``authentication.kubernetes.io/pod-name``, Kubernetes >= 1.30)."""
    group, _, version = obj["apiVersion"].rpartition("/")
    kind = {"group": group, "version": version, "kind": obj["kind"]}
    resource = {"group": group, "version": version, "resource": kind_to_resource(obj["kind"])}
    groups = ["system:authenticated"]
    if user.startswith("system:serviceaccount:"):
        groups[:0] = ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}"]
    extra = {"authentication.kubernetes.io/pod-name": [pod_name]} if pod_name else {}
    return {"kind": kind, "resource": resource, "requestKind": kind, "requestResource": resource,
            "name": obj["metadata"].get("name", ""), "namespace": namespace,
            "operation": operation, "userInfo": {"username": user, "uid": "", "groups": groups, "extra": extra},
            "dryRun": False, "options": {}}


def admit(policy_docs: list[dict], obj: dict, operation: str, user: str, pod_name: str | None = None,
          old_object: dict | None = None, namespace: str | None = None,
          namespace_labels: dict[str, str] | None = None) -> Decision:
    """Whether the API server admits ``operation`` on ``obj`` by ``user`` under the policy and binding of
    ``policy_docs`` (the YAML documents of a ValidatingAdmissionPolicy file, e.g. infra/k8s/admission.yaml).

    Args:
        obj: the object created or updated (as after defaulting), or the object deleted (``operation`` DELETE).
        operation: CREATE, UPDATE, DELETE or CONNECT.
        user: the request's user name (``system:serviceaccount:<namespace>:<name>`` for a service account).
        pod_name: the pod whose service-account token made the request, or None (a token bound to no pod).
        old_object: the object before an UPDATE (required for UPDATE, ignored otherwise).
        namespace: the namespace the request is made in; default, ``obj``'s ``metadata.namespace`` (a manifest
            without one is created in the namespace of the client that sends it, e.g. Argo's workflow's).
        namespace_labels: the labels of ``obj``'s namespace; default, the ``kubernetes.io/metadata.name`` label the
            API server sets on every namespace.

    Returns:
        :class:`Decision`; refused where a validation is false, or errs under ``failurePolicy: Fail``.

    Raises:
        ValueError: ``operation`` unknown, an UPDATE without ``old_object``, no policy or no binding of it in
            ``policy_docs``, or a policy with ``paramKind`` (parameters are not supported here).
        celpy.CELParseError: an expression that is not CEL.
    """
    if operation not in OPERATIONS:
        raise ValueError(f"operation {operation!r}: one of {', '.join(OPERATIONS)}")
    if operation == "UPDATE" and old_object is None:
        raise ValueError("an UPDATE needs old_object, the object before the change")
    policies = [d for d in policy_docs if d and d.get("kind") == "ValidatingAdmissionPolicy"]
    if len(policies) != 1:
        raise ValueError(f"expected one ValidatingAdmissionPolicy among the documents, found {len(policies)}")
    (policy,) = policies
    spec, name = policy["spec"], policy["metadata"]["name"]
    bindings = [d for d in policy_docs if d and d.get("kind") == "ValidatingAdmissionPolicyBinding"
                and d["spec"]["policyName"] == name]
    if not bindings:
        raise ValueError(f"no ValidatingAdmissionPolicyBinding binds the policy {name}: it would never apply")
    if spec.get("paramKind"):
        raise ValueError(f"the policy {name} has paramKind: parameters are not supported by this evaluator")
    obj, old_object = _without_nulls(obj), _without_nulls(old_object)
    new = None if operation == "DELETE" else obj
    old = obj if operation == "DELETE" else old_object if operation == "UPDATE" else None
    namespace_name = namespace or obj["metadata"].get("namespace", "")
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace_name, "labels": namespace_labels or {"kubernetes.io/metadata.name": namespace_name}}}
    request = _request(obj, operation, user, pod_name, namespace_name)
    bound = [b for b in bindings if _matches(b["spec"].get("matchResources"), request, [new, old], namespace)]
    if not _matches(spec.get("matchConstraints"), request, [new, old], namespace) or not bound:
        return Decision(True, (), False)
    fail = spec.get("failurePolicy", "Fail") == "Fail"
    activation: dict[str, Any] = {key: celpy.json_to_cel(value) for key, value in (
        ("request", request), ("object", new), ("oldObject", old), ("namespaceObject", namespace), ("params", None))}
    errors = []
    for condition in spec.get("matchConditions") or []:
        value = evaluate(condition["expression"], activation)
        if isinstance(value, celpy.CELEvalError):
            errors.append(f"matchCondition {condition['name']!r} resulted in error: {value.args[0]}")
        elif not isinstance(value, celtypes.BoolType):
            errors.append(f"matchCondition {condition['name']!r} gave {value!r}, not a bool")
        elif not value:
            return Decision(True, (), False)
    if errors:
        return Decision(not fail, tuple(errors) if fail else (), True)
    activation["variables"] = _Variables(spec.get("variables") or [], activation)
    messages = []
    for validation in spec.get("validations") or []:
        value = evaluate(validation["expression"], activation)
        if isinstance(value, celpy.CELEvalError):
            if fail:
                messages.append(f"expression {validation['expression']!r} resulted in error: {value.args[0]}")
        elif value is not True and value != celtypes.BoolType(True):
            messages.append(_message(validation, activation))
    denies = any("Deny" in b["spec"].get("validationActions", []) for b in bound)
    return Decision(not (messages and denies), tuple(messages), True)


def _without_nulls(value: Any) -> Any:
    """``value`` without the map entries set to null (an unset field, as the API server decodes JSON)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


def _message(validation: dict, activation: dict[str, Any]) -> str:
    """The message of a failed validation, as the API server chooses it."""
    if "messageExpression" in validation:
        text = evaluate(validation["messageExpression"], activation)
        if isinstance(text, str) and text.strip() and "\n" not in text:
            return str(text)
    return validation.get("message") or f"failed expression: {validation['expression']}"


def parse_error(expression: str) -> str | None:
    """Why ``expression`` is not CEL (the parser's message), or None when it parses."""
    try:
        _program(expression)
    except celpy.CELParseError as error:
        return str(error)
    return None


def called_functions(expression: str) -> set[str]:
    """The names of the functions and methods ``expression`` calls (macros included: ``all``, ``map``, ``has``)."""
    tree = _ENV.compile(expression)
    return {str(node.children[1] if node.data == "member_dot_arg" else node.children[0])
            for node in tree.iter_subtrees() if node.data in ("member_dot_arg", "ident_arg")}

