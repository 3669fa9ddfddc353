"""The quality gate of the registry and the compare-and-set move of ``champion``.

A version may become ``champion`` only when the lower bound of the paired 95 % interval of its pass@1 gain
(:func:`grpo_steps.evaluate.paired_gain`, per held-out prompt) beats ``registry.min_improvement``, against the
baseline and against the current champion on the same prompts (:func:`gate`). The per-prompt scores of every
registered version are kept as a run artifact (:data:`PER_PROMPT_ARTIFACT`), so a later version can be compared
with the champion prompt by prompt; a champion scored on other prompts (another eval split) is never replaced
on that basis: the gate says so and holds.

MLflow has no atomic compare-and-set for aliases, so :func:`settle_champion` converges instead: every version
that passed its gate is tagged ``gate.passed=true`` before any alias moves; each registrar then sets
``champion`` to the best of those contenders (:func:`best_contender`: highest pass@1, the earlier version on a
tie), re-reads the alias and the contenders, and repeats until what it reads is what it would set. Whoever
writes last has read every contender tagged before its read, so two concurrent registrations end with the
better version as champion, whatever the interleaving.
"""

from __future__ import annotations

import json
import math

from grpo_steps.evaluate import paired_gain

GATE_METRIC = "pass@1"
PER_PROMPT_ARTIFACT = "eval/per_prompt.json"
"""Run artifact of a registered version: ``{"prompt_keys": [...], "pass@1": [...]}`` of its trained policy."""
PASSED_TAG, REASON_TAG, SCORE_TAG = "gate.passed", "gate.reason", "eval.pass_at_1"
SETTLE_ROUNDS = 10


def _beats(name: str, after: list[float], before: list[float], margin: float) -> tuple[bool, str]:
    gain, half_width = paired_gain(before, after)
    lower = gain - half_width
    verdict = not math.isnan(lower) and lower > margin
    return verdict, (f"{GATE_METRIC} gain over the {name} {gain:+.3f} ± {half_width:.3f} (paired 95 % interval "
                     f"over {len(after)} prompts, lower bound {lower:+.3f}) {'beats' if verdict else 'does not beat'} "
                     f"registry.min_improvement {margin:.3f}")


def gate(trained: list[float], baseline: list[float], champion: list[float] | None, margin: float,
         champion_note: str = "") -> tuple[bool, str]:
    """Whether a trained policy may become ``champion``, and why (one sentence per comparison).

    Args:
        trained, baseline: per-prompt pass@1 (0..1) of the trained policy and the base weights, same prompts.
        champion: the current champion's per-prompt pass@1 on the same prompts; None when there is no champion,
            or when its scores are not comparable (``champion_note`` then says why, and the gate holds).
        margin: ``registry.min_improvement`` (0..1): the interval's lower bound must exceed it.

    >>> gate([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], None, 0.0)[0]
    True
    >>> gate([0.5] + [0.0] * 19, [0.0] * 20, None, 0.0)[0]  # +0.025, far inside its own interval
    False
    """
    passed, reason = _beats("baseline", trained, baseline, margin)
    reasons = [reason]
    if passed and champion_note:
        passed = False
        reasons.append(champion_note)
    elif passed and champion is not None:
        passed, reason = _beats("champion", trained, champion, margin)
        reasons.append(reason)
    return passed, "; ".join(reasons)


def champion_scores(client, name: str, keys: list[str]) -> tuple[str | None, list[float] | None, str]:
    """The current champion of ``name``: ``(version, per-prompt pass@1 in the order of keys, note)``.

    ``(None, None, "")`` without a champion; the scores are None and the note says why when the champion has no
    per-prompt scores (registered before they were kept) or was scored on other prompts.
    """
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
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
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="grpo-per-prompt-") as folder:
        try:
            path = client.download_artifacts(run_id, PER_PROMPT_ARTIFACT, folder)
        except (MlflowException, OSError):
            return None
        with open(path) as file:
            return json.load(file)


def best_contender(versions) -> str | None:
    """The version that should be champion among model versions tagged ``gate.passed=true``: the highest
    ``eval.pass_at_1`` tag, the earlier version on a tie; None when there is none."""
    passed = [v for v in versions if v.tags.get(PASSED_TAG) == "true" and SCORE_TAG in v.tags]
    if not passed:
        return None
    return str(max(passed, key=lambda v: (float(v.tags[SCORE_TAG]), -int(v.version))).version)


def settle_champion(client, name: str, since_version: str | None) -> str | None:
    """Move ``champion`` of ``name`` to the best contender registered since ``since_version`` (the champion this
    registrar's gate compared with, included; None: all versions), re-read, and repeat until stable (at most
    :data:`SETTLE_ROUNDS` times). Returns the champion's version as last read."""
    from mlflow.exceptions import MlflowException

    floor = int(since_version) if since_version else 0
    current = None
    for _ in range(SETTLE_ROUNDS):
        contenders = [v for v in client.search_model_versions(f"name = '{name}'") if int(v.version) >= floor]
        best = best_contender(contenders)
        try:
            current = str(client.get_model_version_by_alias(name, "champion").version)
        except MlflowException:
            current = None
        if best is None or best == current:
            return current
        try:
            client.set_registered_model_alias(name, "champion", best)
        except MlflowException:  # another registrar created the alias first (a unique-key clash): read again
            continue
    return current
