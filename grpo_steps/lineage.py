"""Lineage of registered versions: which version a run started from, which rows its chain has seen.

A version's *chain* is the versions it descends from: v1 <- v2 <- v3 when run 2 started from v1
(``models:/<name>@champion``) and run 3 from v2. Each run keeps, as an artifact of its MLflow run
(:data:`SEEN_ARTIFACT`), the digests (:func:`row_digest`) of every row its chain trained on and of every held-out row,
cumulative: the start version's record plus this run's splits. With ``data.skip_seen`` a run trains only on rows
outside both sets, and evaluates on rows its chain never trained on (:meth:`SeenRows.unseen`).

A row's digest covers its question (the last message of its prompt: a changed system prompt or few-shot examples do
not make old rows new; the same text deduplication keys on) and its answer, as canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from typing import Any

SEEN_ARTIFACT = "lineage/seen_rows.json"
"""Run artifact: ``{"trained": [row digests], "held_out": [row digests]}``, cumulative over the run's chain."""
PARENT_TAG, PARENT_MODEL_TAG = "lineage.parent_version", "lineage.parent_model"
"""Run and version tags: the version a run started from and its registered model's name."""
ROWS_ADDED_TAG, ROWS_ARTIFACT_TAG = "lineage.rows_added", "lineage.rows_artifact"
"""Run and version tags: rows this run trained on that its chain had not (a count), and where the chain's rows are."""
SCORE_TAG = "eval.pass_at_1"


def row_digest(row: dict[str, Any]) -> str:
    """Hex SHA-256 of a prepared row's question and answer (canonical JSON).

    >>> system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}
    >>> a = {"prompt": [system, user], "answer": "2"}
    >>> b = {"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}
    >>> row_digest(a) == row_digest(b), row_digest(a) == row_digest({**b, "answer": "3"})
    (True, False)
    """
    prompt = row["prompt"]
    question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    blob = json.dumps({"question": question, "answer": row.get("answer")}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class SeenRows:
    """The rows a chain has seen: ``trained`` and ``held_out`` row digests (:func:`row_digest`)."""

    trained: frozenset[str] = frozenset()
    held_out: frozenset[str] = frozenset()

    def unseen(self, rows: list[dict], num_eval: int) -> tuple[list[dict], int]:
        """``rows`` (in order) without those the chain trained on, and past the first ``num_eval`` (the eval split)
        without the chain's held-out rows either; returns ``(rows kept, rows left out)``. With the same source and
        seed the eval split is the chain's own: no held-out row was ever trained on.

        >>> rows = [{"prompt": q, "answer": None} for q in "abcde"]
        >>> seen = SeenRows(trained=frozenset({row_digest(rows[0])}), held_out=frozenset({row_digest(rows[3])}))
        >>> kept, left_out = seen.unseen(rows, 1)
        >>> [r["prompt"] for r in kept], left_out
        (['b', 'c', 'e'], 2)
        """
        pool = [row for row in rows if row_digest(row) not in self.trained]
        kept = pool[:num_eval] + [row for row in pool[num_eval:] if row_digest(row) not in self.held_out]
        return kept, len(rows) - len(kept)

    def after(self, train: list[dict], held_out: list[dict]) -> SeenRows:
        """This record with a run's train and eval splits added (what the run's version has seen)."""
        return SeenRows(self.trained | {row_digest(r) for r in train},
                        self.held_out | {row_digest(r) for r in held_out})

    def new_rows(self, train: list[dict]) -> int:
        """How many of ``train`` the chain had not trained on."""
        return sum(row_digest(r) not in self.trained for r in train)


def save_seen(client, run_id: str, seen: SeenRows) -> None:
    """Keep ``seen`` as :data:`SEEN_ARTIFACT` of the MLflow run ``run_id`` (``client``: an ``MlflowClient``)."""
    client.log_dict(run_id, {"trained": sorted(seen.trained), "held_out": sorted(seen.held_out)}, SEEN_ARTIFACT)


def run_json(client, run_id: str, artifact: str) -> Any:
    """The JSON artifact ``artifact`` of the MLflow run ``run_id``, parsed, or None when the run has none."""
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="grpo-run-json-") as folder:
        try:
            path = client.download_artifacts(run_id, artifact, folder)
        except (MlflowException, OSError):
            return None
        with open(path) as file:
            return json.load(file)


def load_seen(client, run_id: str) -> SeenRows | None:
    """:data:`SEEN_ARTIFACT` of the MLflow run ``run_id``, or None when the run has none (a version registered
    before lineage was kept)."""
    record = run_json(client, run_id, SEEN_ARTIFACT)
    return None if record is None else SeenRows(frozenset(record["trained"]), frozenset(record["held_out"]))


def chain(client, name: str, version: str, limit: int = 50) -> list[tuple[str, str]]:
    """``[(version, pass@1 tag or "?"), ...]`` from the first version of ``version``'s chain in registered model
    ``name`` to ``version`` itself, following :data:`PARENT_TAG` (a parent in another registered model ends it;
    ``limit`` bounds the walk)."""
    links: list[tuple[str, str]] = []
    current: str | None = str(version)
    while current and len(links) < limit:
        tags = client.get_model_version(name, current).tags
        links.append((current, tags.get(SCORE_TAG, "?")))
        current = tags.get(PARENT_TAG) if tags.get(PARENT_MODEL_TAG) == name else None
    return links[::-1]


def chain_text(links: list[tuple[str, str]]) -> str:
    """The chain as a version's description shows it.

    >>> chain_text([("1", "0.25"), ("2", "0.5")])
    '**Lineage**: v1 (pass@1 0.25) <- v2 (pass@1 0.5)'
    """
    return "**Lineage**: " + " <- ".join(f"v{v} (pass@1 {score})" for v, score in links)


def versions_table(versions, aliases: dict[str, str], limit: int = 5000) -> str:
    """A registered model's description: pass@1 per version with its parent, the rows it added and its aliases as of
    the last registration (``versions``: its ``ModelVersion`` objects; ``aliases``: the registered model's, alias ->
    version, as ``get_registered_model`` gives them: searched versions come without theirs), newest first and at most
    ``limit`` characters, as a Markdown table MLflow's model page renders.

    >>> from types import SimpleNamespace as V
    >>> print(versions_table([V(version=1, tags={SCORE_TAG: "0.25", ROWS_ADDED_TAG: "60"}),
    ...                       V(version=2, tags={SCORE_TAG: "0.5", PARENT_TAG: "1"})], {"champion": "2"}))
    | version | pass@1 | parent | rows added | aliases |
    |---|---|---|---|---|
    | v2 | 0.5 | v1 |  | champion |
    | v1 | 0.25 |  | 60 |  |
    """
    rows = ["| version | pass@1 | parent | rows added | aliases |", "|---|---|---|---|---|"]
    for v in sorted(versions, key=lambda v: -int(v.version)):
        parent = f"v{v.tags[PARENT_TAG]}" if PARENT_TAG in v.tags else ""
        named = sorted(alias for alias, version in aliases.items() if str(version) == str(v.version))
        row = f"| v{v.version} | {v.tags.get(SCORE_TAG, '')} | {parent} | {v.tags.get(ROWS_ADDED_TAG, '')} | " \
              f"{', '.join(named)} |"
        if sum(len(r) + 1 for r in rows) + len(row) > limit:  # MLflow's SQL stores keep 5000 characters
            break
        rows.append(row)
    return "\n".join(rows)
