"""One redaction for everything that leaves the process: MLflow params, tags and tables, Metaflow artifacts, job
files, log lines, error messages, the card and the registered version's description.

Credentials belong in process variables (``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, ``VLLM_API_KEY``,
``GRPO_SERVER_TOKEN``, ``AWS_*``, ``HF_TOKEN``); the config refuses them anywhere in its tree
(:func:`credential_in`, :func:`secret_name`, used by ``grpo_steps.config``), and :func:`redact` replaces any that
still reach a string with ``***``. It parses rather than guesses where it can:

- URLs go through :func:`urllib.parse.urlsplit`: the userinfo (``https://user:pw@host`` -> ``https://***@host``)
  and the value of every secret-named query or fragment key (``?token=``, ``?api_key=``, ``X-Amz-Signature``,
  ``X-Amz-Credential``, Azure SAS ``sig``, ``#access_token=``);
- names in any case style (``secretAccessKey``, ``SECRET_ACCESS_KEY``, ``secret-access-key``) are split into words
  (:func:`secret_name`): the value after a secret flag (``--api-key KEY``, ``--hf-token=T``) and after a secret
  key (``password=x``, ``"apiKey": "x"``, ``{'hub_token': 123}``) is masked, whatever its type in a dict
  (:func:`redact_value`);
- ``Bearer``/``Basic`` credentials and the well-known token shapes (:data:`TOKEN_SHAPES`) are masked anywhere.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

MASK = "***"
SECRET_WORDS = frozenset((
    "token", "secret", "password", "passwd", "pwd", "passphrase", "credential", "credentials", "auth",
    "authorization", "apikey", "signature", "sig", "cookie", "privatekey", "accesskey", "secretkey", "accesstoken",
    "jwt", "bearer", "dsn", "webhook", "webhooks", "sessionid", "sessionkey", "connstr", "connectionstring", "sas",
    "otp", "totp", "hotp", "passcode"))
"""A name one of whose words (see :func:`secret_name`) is one of these names a secret."""
KEY_QUALIFIERS = frozenset(("api", "access", "secret", "private", "client", "account", "master", "signing",
                            "encryption", "auth", "subscription", "x"))
"""``key`` names a secret after one of these words even before another word (``api_key_value``, ``x-api-key``)."""
LAST_WORD_SECRETS = frozenset(("key", "pass", "session", "pw", "pin", "private"))
"""These name a secret as a name's last word (``openai_key``, ``AccountKey``, ``db_pass``, ``user_session``), not
before another word (``pass_at_k``, ``session_id``, ``pin_memory``,
``private_network``): see :data:`NOT_SECRET_NAMES` for the exceptions."""
NOT_SECRET_NAMES = frozenset((
    "sort_key", "answer_key", "group_key", "cache_key", "dict_key", "hash_key", "partition_key", "primary_key",
    "foreign_key", "join_key", "label_key", "text_key", "prompt_key", "metric_key", "split_key", "index_key",
    "column_key", "field_key", "lookup_key", "row_key", "id_key", "dedup_key", "sample_key", "task_key"))
"""Names ending in ``key`` that name a dictionary or data key, not a credential (compared on their words joined by
``_``: ``sortKey`` and ``sort-key`` too)."""
SECRET_ANYWHERE = frozenset(("webhook", "webhooks", "dsn"))
"""A webhook's URL or a DSN is itself the credential: secret even before a :data:`NOT_SECRET_TAILS` word
(``webhook_url``, ``sentry_dsn_uri``), unless the name ends in ``env``/``file``/``path`` (where one is found)."""
NOT_SECRET_TAILS = frozenset(("id", "ids", "count", "counts", "len", "length", "limit", "env", "file", "path", "dir",
                              "column", "columns", "name", "type", "mode", "url", "uri", "endpoint"))
"""A name ending in one of these words names something about a secret, not one (``stop_token_ids``,
``hub_token_env``, ``token_url``)."""
TOKEN_SHAPES = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----[\s\S]*?(?:-----END [A-Z0-9 ]*-----|$)"  # a PEM key, to its end
    r"|\b(?:(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids (long-term, temporary)
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,}"  # GitHub tokens
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|npm_[A-Za-z0-9]{30,}"  # npm access tokens
    r"|(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}|whsec_[0-9A-Za-z]{16,}"  # Stripe secret and restricted keys, webhooks
    r"|hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|glpat-[A-Za-z0-9_-]{20,}|AIza[0-9A-Za-z_-]{35}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)"  # a JWT: base64url '{"' header and payload
    r"|https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+"  # a Slack webhook: the URL is the key
    r"|https://(?:discord(?:app)?\.com)/api/webhooks/[A-Za-z0-9/_-]+"
    r"|\bya29\.[0-9A-Za-z_-]{20,}"  # a Google OAuth access token
    r"|\b(?:bot)?[0-9]{6,12}:AA[0-9A-Za-z_-]{30,}")  # a Telegram bot token (also in api.telegram.org/bot<token>/)
"""Well-known credential shapes, masked wherever they stand."""
_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.-]*://"
_URL = re.compile(rf"\b{_SCHEME}(?:(?!{_SCHEME})[^\s'\"<>`])+")  # ends where another URL starts: [u](u), ?next=u
_FLAG_EQ = re.compile(r"(?P<flag>--?[A-Za-z][\w-]*)=(?P<value>\S+)")
# the value after a space, or after '", "' in a printed list of arguments (["--api-key", "K"])
_FLAG_SPACE = re.compile(r"(?P<flag>--?[A-Za-z][\w-]*)(?P<sep>\s+|[\"'],\s*[\"'])(?P<value>(?!-)[^\s\"']+)")
_PAIR = re.compile(r"(?P<key>\b[A-Za-z][\w.-]*)(?P<sep>[\"']?\s*[=:]\s*)"
                   r"(?:(?P<quote>[\"'])(?P<quoted>[^\"'\n]*)(?P=quote)|(?P<value>[^\s&,;\"'}\])]+))")
# HTTP credentials as written in headers and logs; case-sensitive and 8+ characters: not "token ids", "basic task"
_BEARER = re.compile(r"\b(?P<scheme>Bearer|bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}")
_SCHEMES = ("bearer", "basic", "token")


def name_words(name: str) -> list[str]:
    """The lower-case words of a name in any case style.

    >>> name_words("secretAccessKey"), name_words("X-Amz-Signature"), name_words("HF_TOKEN")
    (['secret', 'access', 'key'], ['x', 'amz', 'signature'], ['hf', 'token'])
    """
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)  # camelCase -> camel Case
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", name)  # HTTPHeader -> HTTP Header
    return [word for word in re.split(r"[^a-z0-9]+", name.lower()) if word]


def secret_name(name: str) -> bool:
    """Whether a flag, key or parameter name names a secret: one of its words (:func:`name_words`) is in
    :data:`SECRET_WORDS`, its last word is in :data:`LAST_WORD_SECRETS` (``<word>_key``, ``db_pass``), or ``key``
    follows a :data:`KEY_QUALIFIERS` word (``api_key_value``); not when it ends in a :data:`NOT_SECRET_TAILS` word
    (but a :data:`SECRET_ANYWHERE` word), nor for the :data:`NOT_SECRET_NAMES` (``sort_key``).

    >>> [secret_name(n) for n in ("--api-key", "HF_TOKEN", "secretAccessKey", "sig", "X-Amz-Credential", "key")]
    [True, True, True, True, True, True]
    >>> [secret_name(n) for n in ("openai_key", "db_pass", "webhook_url", "sentry_dsn", "user_pwd", "jwt")]
    [True, True, True, True, True, True]
    >>> [secret_name(n) for n in ("max_completion_tokens", "stop_token_ids", "--tokenizer", "answer_key", "sortKey")]
    [False, False, False, False, False]
    >>> [secret_name(n) for n in ("pass@1", "pass_at_k", "session_id", "webhook_url_env")]
    [False, False, False, False]
    >>> [secret_name(n) for n in ("pin", "sas", "connection_string", "private", "otp", "pin_memory", "private_network")]
    [True, True, True, True, True, False, False]
    """
    words = name_words(name)
    if not words or "_".join(words) in NOT_SECRET_NAMES:
        return False
    if any(word in SECRET_ANYWHERE for word in words) and words[-1] not in ("env", "file", "path"):
        return True
    if words[-1] in NOT_SECRET_TAILS:
        return False
    if any(word in SECRET_WORDS for word in words) or words[-1] in LAST_WORD_SECRETS:
        return True
    if any(a + b in SECRET_WORDS for a, b in zip(words, words[1:], strict=False)):  # connection_string, access_token
        return True
    return any(word == "key" and i and words[i - 1] in KEY_QUALIFIERS for i, word in enumerate(words))


def is_secret_flag(arg: str) -> bool:
    """Whether a command-line flag names a secret (its value, the next argument or after ``=``, is one).

    >>> is_secret_flag("--api-key"), is_secret_flag("--hf-token=x"), is_secret_flag("--max-model-len")
    (True, True, False)
    """
    name = arg.split("=", 1)[0]
    return name.startswith("-") and secret_name(name)


def _redact_query(query: str) -> str:
    """A query string or fragment (``a=1&token=x``) with the value of every secret-named key masked."""
    pieces = []
    for piece in re.split(r"([&;])", query):  # the separators are kept, so the string is rebuilt exactly
        key, eq, value = piece.partition("=")
        pieces.append(f"{key}={MASK}" if eq and value and secret_name(urllib.parse.unquote_plus(key)) else piece)
    return "".join(pieces)


def redact_url(url: str) -> str:
    """``url`` with its userinfo and the values of its secret-named query and fragment keys masked (parsed by
    :func:`urllib.parse.urlsplit`; a URL it cannot parse is masked whole).

    >>> redact_url("https://u:pw@s3.example.com/b/k?X-Amz-Credential=AK%2F1&X-Amz-Signature=ab12&x=1#access_token=t")
    'https://***@s3.example.com/b/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1#access_token=***'
    >>> redact_url("sqlite:///mlflow.db")
    'sqlite:///mlflow.db'
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. a malformed IPv6 host: nothing of it can be shown safely
        return MASK
    netloc = f"{MASK}@{parts.netloc.rpartition('@')[2]}" if "@" in parts.netloc else parts.netloc
    query, fragment = _redact_query(parts.query), _redact_query(parts.fragment)
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url  # unchanged, byte for byte (urlunsplit would normalise e.g. sqlite:/// to sqlite:/)
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if "?" in url else "")
            + (f"#{fragment}" if "#" in url else ""))


def _pair(match: re.Match) -> str:
    value = match["quoted"] if match["quote"] else match["value"]
    quote = match["quote"] or ""
    if quote and value and not secret_name(match["key"]):  # "prompt": "connect with password=x": the pairs inside
        return f"{match['key']}{match['sep']}{quote}{_PAIR.sub(_pair, value)}{quote}"
    if not secret_name(match["key"]) or not value or value == MASK or value.lower() in _SCHEMES:
        return match[0]
    return f"{match['key']}{match['sep']}{quote}{MASK}{quote}"


def redact(text: str) -> str:
    """``text`` with every credential in it replaced by ``***`` (see the module docstring).

    >>> redact("[vllm] serving https://me:s3cret@gpu.example.com:8000 --api-key KEY --port 8000")
    '[vllm] serving https://***@gpu.example.com:8000 --api-key *** --port 8000'
    >>> redact("sqlite:///mlflow.db token=abc&x=1 Authorization: Bearer eyJhbGciOi")
    'sqlite:///mlflow.db token=***&x=1 Authorization: Bearer ***'
    >>> print(redact("{'secretAccessKey': 'a b', 'hub_token': 123}"))
    {'secretAccessKey': '***', 'hub_token': ***}
    """
    text = _URL.sub(lambda m: redact_url(m[0]), text)
    text = _FLAG_EQ.sub(lambda m: f"{m['flag']}={MASK}" if secret_name(m["flag"]) else m[0], text)
    text = _FLAG_SPACE.sub(lambda m: f"{m['flag']}{m['sep']}{MASK}" if secret_name(m["flag"]) else m[0], text)
    text = _BEARER.sub(lambda m: f"{m['scheme']} {MASK}", text)
    text = _PAIR.sub(_pair, text)
    text = _DSN_USERINFO.sub(lambda m: f"{MASK}@{m[0].rpartition('@')[2]}", text)  # user:password@host, no scheme
    return TOKEN_SHAPES.sub(MASK, text)


def redact_args(args: list[str]) -> list[str]:
    """A command line with the value of every secret flag (``--api-key KEY``, ``--api-key=KEY``) replaced by ``***``.

    >>> redact_args(["--api-key", "KEY", "--port", "8000", "--hf-token=T"])
    ['--api-key', '***', '--port', '8000', '--hf-token=***']
    """
    out: list[str] = []
    for i, arg in enumerate(args):
        if i and is_secret_flag(args[i - 1]) and "=" not in args[i - 1] and not arg.startswith("-"):
            out.append(MASK)
        else:
            out.append(redact(arg))
    return out


def holds_a_value(value: Any) -> bool:
    """Whether a value under a secret name is one (not an unset ``None``/``""`` or a ``True``/``False`` switch)."""
    return value is not None and value != "" and not isinstance(value, bool)


def redact_value(value: Any) -> Any:
    """``value`` (a config dump, an artifact, a table, a handle) with every string redacted, lists of command-line
    arguments by :func:`redact_args`, and every entry under a secret name (:func:`secret_name`) replaced whole,
    whatever its type (a string, a number, a list, a mapping).

    >>> redact_value({"options": {"apiKey": 12345, "n": 3}, "args": ["--hf-token", "t"], "use_auth": True})
    {'options': {'apiKey': '***', 'n': 3}, 'args': ['--hf-token', '***'], 'use_auth': True}
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: MASK if isinstance(k, str) and secret_name(k) and holds_a_value(v) else redact_value(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = redact_args(list(value)) if all(isinstance(v, str) for v in value) else [redact_value(v)
                                                                                          for v in value]
        return type(value)(items)
    return value


def redact_report(report: Any) -> Any:
    """The evaluation report (the ``evaluate`` step's ``eval_report``: metrics, samples, per-prompt rows) as it may
    leave the process (a Metaflow artifact, the card): every string and string key redacted (:func:`redact`: a
    completion or a tool's answer can hold what a tool read), a string under a secret name (a dataset column such as
    ``api_key``) replaced whole; numbers stay, whatever their key (``pass@1``, a metric of a prompt that says
    "password"), so the report's figures are exactly the measured ones.

    >>> redact_report({"metrics": {"pass@1": 0.5}, "samples": [{"completion": "password=hunter22", "api_key": "k1"}]})
    {'metrics': {'pass@1': 0.5}, 'samples': [{'completion': 'password=***', 'api_key': '***'}]}
    """
    if isinstance(report, str):
        return redact(report)
    if isinstance(report, dict):
        return {(redact(k) if isinstance(k, str) else k):
                MASK if isinstance(k, str) and isinstance(v, str) and v and secret_name(k) else redact_report(v)
                for k, v in report.items()}
    if isinstance(report, (list, tuple)):
        if report and all(isinstance(v, str) for v in report):  # a command line a tool ran: --api-key KEY
            return type(report)(redact_args(list(report)))
        return type(report)(redact_report(v) for v in report)
    return report


def credential_in(text: str) -> str | None:
    """What credential ``text`` holds inline, or None: ``"URL userinfo"``, ``"a secret URL parameter (NAME)"``,
    ``"a secret flag"``, ``"a token"`` (a ``Bearer`` credential or a :data:`TOKEN_SHAPES` shape). Free text such
    as ``answer key: B`` is not a credential; use :func:`redact` on text that leaves the process.

    >>> credential_in("http://u:p@host"), credential_in("--api-key=K"), credential_in("http://host:8000")
    ('URL userinfo', 'a secret flag', None)
    >>> credential_in("https://acct.blob.core.windows.net/c?sv=2022&sig=abc")
    'a secret URL parameter (sig)'
    >>> credential_in("Server=db;User Id=me;Password=hunter2;"), credential_in("use the key=value format")
    ('a credential pair (Password=...)', None)
    >>> credential_in("token: x"), credential_in("me:hunter2@db.example.com:5432/app"), credential_in("git@x.org:o/r")
    ('a credential pair (token: ...)', 'a user:password@host DSN', None)
    """
    for match in _URL.finditer(text):
        try:
            parts = urllib.parse.urlsplit(match[0])
        except ValueError:
            return "a URL that does not parse"
        if "@" in parts.netloc:
            return "URL userinfo"
        for piece in re.split(r"[&;]", f"{parts.query}&{parts.fragment}&{parts.path}"):  # ;token= too
            key, _, value = piece.rpartition("/")[2].partition("=")
            if value and secret_name(urllib.parse.unquote_plus(key)):
                return f"a secret URL parameter ({urllib.parse.unquote_plus(key)})"
    if any(secret_name(m["flag"]) for m in _FLAG_EQ.finditer(text)) or is_secret_flag(text):
        return "a secret flag"
    if _BEARER.search(text) or TOKEN_SHAPES.search(text):
        return "a token"
    for match in _ASSIGNED.finditer(text):
        if strong_secret_name(match["key"]):
            return f"a credential pair ({match['key']}=...)"
    if (pair := _WHOLE_PAIR.match(text)) and secret_name(pair["key"]):
        return f"a credential pair ({pair['key']}: ...)"
    if _DSN_USERINFO.search(text):
        return "a user:password@host DSN"
    return None


_DSN_USERINFO = re.compile(r"(?<![\w/.@:-])[A-Za-z0-9._%+-]+:[^\s:@/]+@[A-Za-z0-9.-]+")
"""``user:password@host`` without a scheme (a DSN as some drivers take it)."""
_WHOLE_PAIR = re.compile(r"^\s*[\"']?(?P<key>[A-Za-z][\w.-]*)[\"']?\s*[:=]\s*(?P<value>\S.*?)\s*$")
"""A string that is one ``name: value`` (or ``name=value``) pair: a header line, a YAML line given as a string."""
_HEX40 = re.compile(r"[0-9a-f]{40}")
_AWS_SECRET = re.compile(r"(?=[^/]*[A-Z])(?=.*[a-z])(?=.*[0-9])[A-Za-z0-9][A-Za-z0-9/+]{39}")
HASH_WORDS = frozenset(("sha", "sha1", "sha256", "hash", "digest", "commit", "revision", "rev", "checksum",
                        "fingerprint", "etag", "version"))
"""A value under a name with one of these words may be a bare 40-hex string (a git commit, a hub revision)."""


def bare_key(name: str, value: str) -> str | None:
    """What bare key ``value`` (a whole string under config key ``name``) has the shape of, or None: 40 lower-case
    hex digits (a Weights & Biases API key; not under a hash-like name: :data:`HASH_WORDS`), or 40 characters of
    ``[A-Za-z0-9/+]`` with upper, lower case and a digit (an AWS secret access key; not under a path-like name).

    >>> hex40 = "0123456789abcdef" * 2 + "01234567"
    >>> bare_key("project", hex40), bare_key("revision", hex40)
    ('a bare 40-hex key (the shape of a Weights & Biases API key)', None)
    >>> bare_key("bucket", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"), bare_key("model", "Qwen/Qwen2.5-0.5B-Instruct")
    ('a bare AWS secret access key', None)
    """
    words = name_words(name)
    if _HEX40.fullmatch(value) and not HASH_WORDS.intersection(words):
        return "a bare 40-hex key (the shape of a Weights & Biases API key)"
    if _AWS_SECRET.fullmatch(value) and not (words and words[-1] in NOT_SECRET_TAILS):
        return "a bare AWS secret access key"
    return None


_ASSIGNED = re.compile(r"(?P<key>\b[A-Za-z][\w.-]*)=(?P<value>[^\s&,;\"'}\])]+)")
"""``name=value`` with no space around ``=``: connection strings (``Password=x;``, ``AccountKey=y``), DSNs, URL
parameters after ``;``."""


def strong_secret_name(name: str) -> bool:
    """A secret name (:func:`secret_name`) that is not one word of everyday prose (``key``, ``pass``, ``session``):
    enough to call ``name=value`` inside free text a credential.

    >>> strong_secret_name("Password"), strong_secret_name("AccountKey"), strong_secret_name("key")
    (True, True, False)
    """
    return secret_name(name) and name_words(name) not in (["key"], ["pass"], ["session"], ["sig"], ["auth"])
