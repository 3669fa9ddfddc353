"""One verified weight push (:class:`VerifiedPush`): the policy's state dict gathered, written and loaded through a
disk push (:mod:`grpo_steps.training.generation.disk`) by rank 0, then every replica asked for its version label and
its probe logprobs (:func:`check_served_version`): an HTTP 200 does not prove the weights changed (vLLM RFC #48312).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from grpo_steps.servers.client import GenerationServerError, VLLMClient
from grpo_steps.training.sampling import policy_logprobs
from grpo_steps.weights.files import weights_fingerprint
from grpo_steps.weights.labels import version_label

HISTORY = 4
"""Verified pushes remembered per replica to name the version a stale server serves."""


@dataclass
class ProbeRecord:
    """What one push's verification saw: ``weights``, the pushed state dict's
    :func:`grpo_steps.weights.files.weights_fingerprint`; ``served``, the server's probe logprobs (T-1 floats);
    ``policy``, the policy's on the same probe, or None when the first rollout batch is compared with the policy
    instead (``generation.sync_check.max_logp_diff``)."""

    version: int
    weights: tuple[float, ...]
    served: list[float]
    policy: list[float] | None = None


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    """Mean |a_t - b_t| over equal-length logprob lists (nats per token; 0 for empty lists)."""
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def served_version(record: ProbeRecord, history: list[ProbeRecord], tolerance: float) -> int | None:
    """Which version's weights the server serves, judged by the probe: an earlier version's when the server's answer
    is that version's own answer bit for bit (within 1e-6) although the pushed weights differ from it and, where
    both pushes have a policy probe, the policy's own answer moved by more than that (the newest such); else
    ``record.version`` when the probe matches the policy's within ``tolerance`` (mean |delta logp|, nats per token),
    or when there is no policy probe; else the newest earlier version whose policy probe it matches; else None.

    The server's forward pass is deterministic for one request, so serving an earlier push's weights shows as that
    push's answer exactly, even when an optimizer step moved the logprobs by less than ``tolerance``; a push of
    unchanged weights (a step without gradient), or of weights that moved too little to change the policy's own
    answer (a gradient of round-off size, e.g. a group whose completions are identical but scored differently), is
    not taken for stale.
    """
    exact = 1e-6
    newest_first = sorted(history, key=lambda r: -r.version)
    for earlier in newest_first:
        policy_moved = record.policy is None or earlier.policy is None or \
            mean_abs_diff(record.policy, earlier.policy) > exact
        if earlier.weights != record.weights and policy_moved and mean_abs_diff(record.served, earlier.served) <= exact:
            return earlier.version
    if record.policy is None or mean_abs_diff(record.served, record.policy) <= tolerance:
        return record.version
    for earlier in newest_first:
        if earlier.policy is not None and mean_abs_diff(record.served, earlier.policy) <= tolerance:
            return earlier.version
    return None


def check_served_version(record: ProbeRecord, history: list[ProbeRecord], label: str, tolerance: float,
                         step: int) -> None:
    """Raise unless the server serves version ``record.version`` (label and probe, see :func:`served_version`).

    Args:
        label: the server's ``/weight_info`` answer after the push.
        step: the optimizer step about to sample (named in the error).

    Raises:
        GenerationServerError: the label is not this version's, or the probe says other weights; the
            message names the step, the expected and the served version.
    """
    expected = version_label(record.version)
    if label != expected:
        raise GenerationServerError(f"step {step}: the generation server reports weight version {label!r}, "
                                    f"expected {expected!r} (was it restarted or reloaded by someone else?)")
    served = served_version(record, history, tolerance)
    if served != record.version:
        served_text = f"version {served} ({version_label(served)})" if served is not None else "unknown weights"
        gap = "" if record.policy is None else (
            f"; probe mean |delta logp| server vs policy {mean_abs_diff(record.served, record.policy):.3g} "
            f"(tolerance {tolerance:g}, generation.sync_check.probe_tolerance)")
        raise GenerationServerError(
            f"step {step}: the generation server does not serve the weights just pushed: expected version "
            f"{record.version} ({expected}), served {served_text}{gap}. Refusing to sample off-policy."
        )


class VerifiedPush:
    """Push the policy and verify that every replica serves it, on every rank (collective under ZeRO-3: the gather
    and the probe's forward); rank 0's failure is raised on every rank.

    Args:
        transport: rank 0's weight transport (:class:`grpo_steps.training.generation.transport.WeightTransport`, from
            :func:`~grpo_steps.training.generation.transport.make_transport`; None on the other ranks), told
            ``committed(version)`` when every replica serves the version.
        probe_ids: the probe sequence's token ids.
        probe_tolerance: nats per token: probe answers closer than this are the same weights.
        probe_policy: whether the policy scores the probe too (:attr:`ServerSettings.probe_policy
            <grpo_steps.training.generation.settings.ServerSettings.probe_policy>`).
        merged_lora: ``train.peft.push: merged``: base + adapter merged, pushed as full weights.
        log: the metric sink, ``log(name, value)``: ``weight_sync/gather_seconds``, ``write_seconds`` (fingerprint and
            files), ``reload_seconds``, ``verify_seconds``, ``seconds`` (the four parts), ``version``, ``replicas``,
            ``probe_logp_diff`` (mean |server - policy| on the probe, nats per token, with ``probe_policy``); with
            ``s3`` sync also ``bytes`` (written to S3), ``raw_bytes``, ``density``, ``anchor``, ``fetch_seconds``
            and ``load_seconds`` (the slowest replica's).
    """

    def __init__(self, transport, probe_ids: list[int], probe_tolerance: float, probe_policy: bool, merged_lora: bool,
                 log: Callable[[str, float], None]) -> None:
        self.transport, self.probe_ids, self.probe_tolerance = transport, probe_ids, probe_tolerance
        self.probe_policy, self.merged_lora, self.log = probe_policy, merged_lora, log
        self.history: dict[str, list[ProbeRecord]] = {}  # per replica (endpoint): the last HISTORY verified pushes

    def __call__(self, policy, version: int) -> None:
        """Push ``policy``'s weights (a :class:`~grpo_steps.training.generation.settings.PolicyView`) as ``version``.

        Raises:
            GenerationServerError: a replica serves other weights than pushed, or rank 0's push failed.
        """
        from accelerate.utils import broadcast_object_list

        accelerator = policy.accelerator
        start = time.perf_counter()
        policy_model = accelerator.unwrap_model(policy.model())
        if self.merged_lora:  # full weights under the base model's names (no ZeRO-3: config-checked)
            from grpo_steps.training.generation.disk import merged_state_dict

            state_dict = merged_state_dict(policy_model) if accelerator.is_main_process else {}
            policy_model = policy_model.get_base_model()
        else:  # as Trainer.save_model: under DeepSpeed the engine gathers (ZeRO-3: a collective, the dict on rank 0)
            state_dict = policy.state_dict()
        gathered = time.perf_counter()
        parts = {"write_seconds": 0.0, "reload_seconds": 0.0}
        error: BaseException | None = None  # rank 0's failure, re-raised on every rank after the broadcast
        weights: tuple[float, ...] = ()
        if accelerator.is_main_process:
            try:
                weights = weights_fingerprint(state_dict)
                parts = self.transport.push(state_dict, version, model=policy_model)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        del state_dict
        pushed = time.perf_counter()
        # every rank: a collective forward under ZeRO-3
        scored = policy_logprobs(policy.model(), self.probe_ids) if self.probe_policy else None
        gap = None
        if accelerator.is_main_process and error is None:
            try:
                gap = self._verify(version, weights, scored)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        if accelerator.is_main_process and error is None:
            try:  # every replica serves the version: the chain's next delta builds on it
                self.transport.committed(version)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        message = broadcast_object_list([None if error is None else f"{type(error).__name__}: {error}"])[0]
        if error is not None:
            raise error
        if message is not None:
            raise GenerationServerError(f"rank 0 failed the weight push of step {version}: {message}")
        done = time.perf_counter()
        self.log("weight_sync/gather_seconds", gathered - start)
        # the fingerprint and the push's bookkeeping count as writing: the parts add up to the total
        self.log("weight_sync/write_seconds", (pushed - gathered) - parts["reload_seconds"])
        self.log("weight_sync/reload_seconds", parts["reload_seconds"])
        self.log("weight_sync/verify_seconds", done - pushed)
        self.log("weight_sync/seconds", done - start)
        self.log("weight_sync/version", float(version))
        if gap is not None:
            self.log("weight_sync/probe_logp_diff", gap)
        for name, value in parts.items():  # s3 sync: bytes, density, anchor, fetch and load seconds
            if name not in ("write_seconds", "reload_seconds"):
                self.log(f"weight_sync/{name}", value)

    def _verify(self, version: int, weights: tuple[float, ...], policy: list[float] | None) -> float | None:
        """Rank 0: check every replica's label and probe, in parallel (see :func:`check_served_version`; each replica
        against its own earlier answers); returns the largest mean |server - policy| probe logp (None without a
        policy probe). With several replicas, one line names each replica's label. Raises GenerationServerError
        (naming the replica)."""
        def check(client: VLLMClient) -> tuple[ProbeRecord, str]:
            record = ProbeRecord(version, weights, client.prompt_logprobs(self.probe_ids), policy)
            label = self.transport.served_label(client)
            check_served_version(record, self.history.get(client.endpoint, []), label, self.probe_tolerance,
                                 step=version + 1)
            return record, label

        client = self.transport.client
        checked = client.each(check)
        for replica, (record, _) in zip(client.replica_clients(), checked, strict=True):
            self.history[replica.endpoint] = (self.history.get(replica.endpoint, []) + [record])[-HISTORY:]
        if client.replicas:
            self.log("weight_sync/replicas", float(len(checked)))
            print(f"[weight-sync] version {version} verified on {len(checked)} replicas: "
                  + ", ".join(f"{r.endpoint} {label}" for r, (_, label) in zip(client.replica_clients(), checked,
                                                                                strict=True)), flush=True)
        return None if policy is None else max(mean_abs_diff(record.served, policy) for record, _ in checked)
