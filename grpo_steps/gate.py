"""The quality gate of the registry and the compare-and-set move of ``champion``.

A version may become ``champion`` only when the lower bound of the paired 95 % interval of its pass@1 gain
(:func:`grpo_steps.evaluation.stats.paired_gain`, per held-out prompt) beats ``registry.min_improvement``, against the
baseline and against the current champion on the same prompts (:func:`gate`). The per-prompt scores of every
registered version are kept as a run artifact (:data:`PER_PROMPT_ARTIFACT`), so a later version can be compared
with the champion prompt by prompt; a champion scored on other prompts (another eval split) is never replaced
on that basis: the gate says so and holds.

MLflow has no atomic compare-and-set for aliases, so :func:`settle_champion` converges instead: every version
that passed its gate is tagged ``gate.passed=true`` (and ``gate.compared_champion``, the champion its gate compared
with) before any alias moves; each registrar then sets ``champion`` to the best of its contenders
(:func:`contenders`, :func:`best_contender`: highest pass@1, the earlier version on a tie), re-reads the alias and
the contenders, and repeats until what it reads is what it would set; then it tags its version
``gate.settled=true``. Whoever writes last has read every contender tagged before its read, so two concurrent
registrations end with the better version as champion, whatever the interleaving.

The contenders are only what this gate judged: this version, the champion it was compared with, and concurrent
registrations that compared with the same champion and have not settled (or settled as the champion). So a version
that lost ``champion`` (a manual rollback v2 -> v1) is never restored by a later registration, a version tagged
``gate.revoked=true`` never takes part, without a champion the new version is judged on its own comparison (not
the all-time best), and a champion moved meanwhile to a version this gate never compared with is left alone.
"""

from __future__ import annotations

import math

from grpo_steps.evaluation.stats import paired_gain
from grpo_steps.lineage import run_json

GATE_METRIC = "pass@1"
PER_PROMPT_ARTIFACT = "eval/per_prompt.json"
"""Run artifact of a registered version: ``{"prompt_keys": [...], "pass@1": [...]}`` of its trained policy."""
PASSED_TAG, REASON_TAG, SCORE_TAG = "gate.passed", "gate.reason", "eval.pass_at_1"
COMPARED_TAG, SETTLED_TAG, REVOKED_TAG = "gate.compared_champion", "gate.settled", "gate.revoked"
"""The champion a version's gate compared with (empty: none); its registration has settled; set by hand: never
champion again."""
SETTLE_ROUNDS = 10


def _beats(name: str, after: list[float], before: list[float], margin: float) -> tuple[bool, str]:
    gain, half_width = paired_gain(before, after)
    lower = gain - half_width
    verdict = not math.isnan(lower) and lower > margin
    return verdict, (f"{GATE_METRIC} gain over the {name} {gain:+.3f} ± {half_width:.3f} (paired 95 % interval "
                     f"over {len(after)} prompts, lower bound {lower:+.3f}) {'beats' if verdict else 'does not beat'} "
                     f"registry.min_improvement {margin:.3f}")


def gate(trained: list[float], baseline: list[float], champion: list[float] | None, margin: float,
         champion_note: str = "", min_prompts: int = 2) -> tuple[bool, str]:
    """Whether a trained policy may become ``champion``, and why (one sentence per comparison).

    Args:
        trained, baseline: per-prompt pass@1 (0..1) of the trained policy and the base weights, same prompts.
        champion: the current champion's per-prompt pass@1 on the same prompts; None when there is no champion,
            or when its scores are not comparable (``champion_note`` then says why, and the gate holds).
        margin: ``registry.min_improvement`` (0..1): the interval's lower bound must exceed it.
        min_prompts: ``registry.min_eval_prompts``: with fewer prompts the gate holds.

    >>> gate([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], None, 0.0)[0]
    True
    >>> gate([0.5] + [0.0] * 19, [0.0] * 20, None, 0.0)[0]  # +0.025, far inside its own interval
    False
    """
    passed, reason = _beats("baseline", trained, baseline, margin)
    reasons = [reason]
    if passed and len(trained) < min_prompts:
        passed = False
        reasons.append(f"{len(trained)} held-out prompts are fewer than registry.min_eval_prompts ({min_prompts}): "
                       "champion not moved")
    if passed and champion_note:
        passed = False
        reasons.append(champion_note)
    elif passed and champion is not None:
        passed, reason = _beats("champion", trained, champion, margin)
        reasons.append(reason)
    return passed, "; ".join(reasons)


def champion_scores(client, name: str, keys: list[str]) -> tuple[str | None, list[float] | None, str]:
    """The current champion of ``name``: ``(version, per-prompt pass@1 in the order of keys, note)``.

    ``(None, None, "")`` without a champion or when the champion is tagged ``gate.revoked=true`` (the gate then
    compares with the baseline alone, and :func:`settle_champion` may replace it); the scores are None and the note
    says why when the champion has no per-prompt scores (registered before they were kept) or was scored on other
    prompts.
    """
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return None, None, ""
    if version.tags.get(REVOKED_TAG) == "true":  # revoked but the alias not moved back yet: never compared with
        return None, None, ""
    record = load_per_prompt(client, version.run_id)
    if record is None or not record.get("prompt_keys"):
        return version.version, None, (f"the champion (version {version.version}) has no per-prompt scores to "
                                       "compare on the same prompts: champion not moved (move it by hand if wanted)")
    by_key = dict(zip(record["prompt_keys"], record[GATE_METRIC], strict=True))
    if set(by_key) != set(keys):
        return version.version, None, (f"the champion (version {version.version}) was evaluated on other prompts "
                                       "(another eval split): champion not moved; evaluate both on one split")
    return version.version, [by_key[k] for k in keys], ""


def save_per_prompt(client, run_id: str, keys: list[str], scores: list[float]) -> None:
    """Keep a version's per-prompt pass@1 as :data:`PER_PROMPT_ARTIFACT` of its run."""
    client.log_dict(run_id, {"prompt_keys": keys, GATE_METRIC: scores}, PER_PROMPT_ARTIFACT)


def load_per_prompt(client, run_id: str) -> dict | None:
    """:data:`PER_PROMPT_ARTIFACT` of a run, or None when the run has none."""
    return run_json(client, run_id, PER_PROMPT_ARTIFACT)


def best_contender(versions) -> str | None:
    """The version that should be champion among model versions tagged ``gate.passed=true``: the highest
    ``eval.pass_at_1`` tag, the earlier version on a tie; None when there is none."""
    passed = [v for v in versions if v.tags.get(PASSED_TAG) == "true" and SCORE_TAG in v.tags]
    if not passed:
        return None
    return str(max(passed, key=lambda v: (float(v.tags[SCORE_TAG]), -int(v.version))).version)


def contenders(versions, version: str, compared: str | None, current: str | None,
               fresh: frozenset[str] = frozenset()) -> list:
    """The model versions a registrar of ``version`` may make champion (see the module docstring): not revoked,
    and ``version`` itself, ``compared`` (the champion its gate compared with; None: there was none), or a
    concurrent registration (tagged with the same ``gate.compared_champion``) that has not settled, is ``current``
    (the champion as just read), or is in ``fresh`` (not settled when this registrar first read: it settled while
    this one was settling, so a late alias write of this registrar must not leave it out)."""
    def concurrent(v) -> bool:
        return v.tags.get(COMPARED_TAG) == (compared or "") and (
            v.tags.get(SETTLED_TAG) != "true" or str(v.version) in fresh or str(v.version) == current)

    return [v for v in versions if v.tags.get(REVOKED_TAG) != "true"
            and (str(v.version) in (version, compared) or concurrent(v))]


def _champion_version(client, name: str) -> str | None:
    """The version ``champion`` of ``name`` points to now, or None when there is none."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, "champion").version)
    except MlflowException:
        return None


def settle_champion(client, name: str, version: str, compared: str | None) -> str | None:
    """Move ``champion`` of ``name`` to the best of :func:`contenders` of ``version`` (whose gate compared with
    ``compared``), re-read, and repeat until stable (at most :data:`SETTLE_ROUNDS` times); a champion that is no
    contender and not revoked was chosen elsewhere (by hand, or by a registrar that compared with another
    champion) and is left as it is. Tags ``version`` settled. Returns the champion's version as last read.

    Raises:
        MlflowException: writing the alias failed and no other registrar had written it meanwhile (the alias reads
            as before the write: missing rights, a server error), so nothing was settled.
    """
    from mlflow.exceptions import MlflowException

    version, compared, current, fresh = str(version), str(compared) if compared is not None else None, None, None
    for _ in range(SETTLE_ROUNDS):
        versions = client.search_model_versions(f"name = '{name}'")
        if fresh is None:  # the versions not yet settled when this registrar began to settle
            fresh = frozenset(str(v.version) for v in versions if v.tags.get(SETTLED_TAG) != "true")
        try:
            current = str(client.get_model_version_by_alias(name, "champion").version)
        except MlflowException:
            current = None
        allowed = contenders(versions, version, compared, current, fresh)
        revoked = {str(v.version) for v in versions if v.tags.get(REVOKED_TAG) == "true"}
        best = best_contender(allowed)
        if best is None or best == current or (
                current is not None and current not in revoked and current not in {str(v.version) for v in allowed}):
            break
        try:
            client.set_registered_model_alias(name, "champion", best)
        except MlflowException:
            if _champion_version(client, name) == current:
                raise  # nobody else wrote the alias: not a clash (missing rights, a server error) but a failure
            continue  # another registrar created the alias first (a unique-key clash): read again
    client.set_model_version_tag(name, version, SETTLED_TAG, "true")
    return current
