"""The ``teacher`` section: on-policy distillation (OPD) beside GRPO. A teacher served by its own vLLM server scores
every token the policy sampled, and the per-token log-ratio joins the advantage (:mod:`grpo_steps.training.distill`;
docs/distillation.md). :func:`teacher_refusal` holds the rules that span sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_steps.config.base import _Section
from grpo_steps.config.serving import ServerConfig

TeacherMode = Literal["mixed", "pure", "privileged"]


class TeacherConfig(_Section):
    """On-policy distillation: ``A_t = A_grpo + kl_coef * (log pi_T(y_t) - log mu(y_t))`` per completion token
    (stop-gradient; ``mu`` the sampler's logprob), the form of ms-swift's ``teacher_kl_coef``, slime's
    ``--opd-kl-coef`` and Thinking Machines' "On-Policy Distillation" (2025). The teacher's server is started and
    stopped with the run's generation server, never receives weights, and must share the policy's tokenizer
    (checked in ``start``)."""

    model: str | None = None
    """The teacher's weights, named as ``model.name_or_path`` is: a local directory, a Hub id, ``embedded:<name>``, or
    a registered version ``models:/<name>@<alias>`` / ``models:/<name>/<version>`` (fetched once and checked by
    digest). Null only with ``mode: privileged``, whose teacher is the policy's starting weights."""
    mode: TeacherMode = "mixed"
    """``mixed``: the teacher's term is added to GRPO's advantage from the task rewards; ``pure``: the task rewards are
    ignored (GRPO's advantage is 0; the rewards are still computed and logged); ``privileged``: self-distillation with
    privileged context: the teacher is the policy's own starting weights, shown the row's reference answer
    (``answer_column``) in its prompt (TRL's experimental SDFT, prime-rl's ``opsd``); no second model, so it runs on
    the embedded one. ``privileged`` mixes with the task rewards as ``mixed`` does."""
    kl_coef: float = Field(1.0, gt=0)
    """lambda: weight of the teacher's per-token log-ratio in the advantage (nats). With ``mixed``, GRPO's advantage
    is about 1 in size (scaled by the group's standard deviation) and the log-ratio of a good student a few tenths:
    1.0 weighs them alike."""
    answer_column: str = "answer"
    """``mode: privileged``: the dataset column holding each row's reference answer, shown to the teacher."""
    provider: Literal["local", "external"] = "local"
    """How the teacher is served: ``local``, a vLLM process on this machine started as the policy's local server is
    (same supervisor, token and flags, ``--logprobs-mode processed_logprobs``); ``external``, a server you run at
    ``server.endpoint`` serving the teacher's weights (``teacher.model`` still names them, for the tokenizer check).
    ``kubernetes`` is not supported: run the teacher in the cluster yourself and name it with ``external``."""
    server: ServerConfig | None = None
    """The teacher server's settings (``generation.server``'s fields); null: ``generation.server``'s with a port of
    its own, one replica and no endpoint (the policy's serving settings reused)."""
    position_buckets: list[int] = Field(default_factory=lambda: [16, 64, 256])
    """Upper bounds (exclusive, tokens) of the completion-position buckets of the logged reverse KL
    (``distill/reverse_kl_pos_<lo>_<hi>``), increasing; positions past the last bound form the last bucket."""

    @model_validator(mode="after")
    def _names_a_teacher(self) -> TeacherConfig:
        if self.mode == "privileged" and self.model is not None:
            raise ValueError(f"teacher.mode 'privileged' distils from the policy's own starting weights, but "
                             f"teacher.model is {self.model!r}: remove teacher.model, or use mode mixed or pure")
        if self.mode != "privileged" and self.model is None:
            raise ValueError(f"teacher.mode {self.mode!r} needs teacher.model (a path, Hub id, embedded:<name> or "
                             "models:/<name>@<alias>); or use mode: privileged, whose teacher is the policy itself")
        if self.provider == "external" and (self.server is None or not self.server.endpoint):
            raise ValueError("teacher.provider 'external' needs teacher.server.endpoint, the URL of the vLLM server "
                             "you run with the teacher's weights")
        if self.position_buckets != sorted(set(self.position_buckets)) or self.position_buckets[:1] == [0]:
            raise ValueError(f"teacher.position_buckets {self.position_buckets} must be increasing positive token "
                             "positions, e.g. [16, 64, 256]")
        return self

    def server_settings(self, policy: ServerConfig) -> ServerConfig:
        """The teacher server's :class:`ServerConfig`: ``server``, or ``policy``'s with port 0, one replica, no
        endpoint."""
        if self.server is not None:
            return self.server
        cores = policy.cpu_cores
        if cores and isinstance(cores[0], list):  # one list per policy replica: the teacher is one server
            cores = sorted({core for replica in cores for core in replica})
        return policy.model_copy(update={"port": 0, "replicas": 1, "endpoint": None, "endpoints": None,
                                         "cpu_cores": cores})


def teacher_refusal(cfg) -> str | None:
    """Why the ``teacher`` of ``cfg`` (a :class:`grpo_steps.config.PipelineConfig`) cannot run with the rest of the
    config (the fix named), or None.

    Refused: settings that read one advantage per completion (the teacher's advantages are per token, as
    ``train.turn_credit``'s); ``generation.temperature`` other than 1 and sampling filters (vLLM's ``prompt_logprobs``
    skip the sampling processors: the teacher scores at temperature 1 with no filter, ``vllm/v1/worker/
    gpu_model_runner.py`` "prompt tokens skip sampling processors", while the sampler's logprobs are of the filtered,
    tempered distribution); a backend without the sampler's per-token logprobs (``hf``, ``recorded``, ``nccl``);
    an ``external`` teacher at the policy's own endpoint (not frozen: it takes the student's weight pushes); a ``local``
    teacher with several training nodes (each node would replace a stale teacher on its own after a resume: serve it
    with ``external``); a ``local`` teacher that would take the policy server's GPUs.
    """
    teacher, train, gen = cfg.teacher, cfg.train, cfg.generation
    if teacher is None:
        return None
    for on, what in ((train.zero_signal_groups != "keep", f"train.zero_signal_groups {train.zero_signal_groups!r}"),
                     (train.off_policy_mask_threshold is not None, "train.off_policy_mask_threshold"),
                     (train.loss_type == "vespo", "train.loss_type 'vespo'")):
        if on:
            return (f"teacher makes the advantages per token, and {what} reads one per completion: remove teacher, "
                    "or that setting")
    if gen.temperature != 1.0 or gen.filters_logits:
        return (f"teacher: vLLM scores the teacher's prompt_logprobs at temperature 1 with no sampling filter, but "
                f"generation samples at temperature {gen.temperature:g}"
                f"{' with sampling filters or structured outputs' if gen.filters_logits else ''}, so the log-ratio "
                "would compare two different distributions: set generation.temperature: 1, leave top_k, top_p, "
                "min_p and repetition_penalty at their defaults and structured_outputs unset")
    if gen.backend != "vllm" or not gen.pushes_to_server:
        return (f"teacher needs the sampler's logprobs of the sampled completions from the pipeline's vLLM server "
                f"(generation.backend vllm with weight_sync disk or s3), not backend {gen.backend!r} / weight_sync "
                f"{gen.weight_sync!r}")
    if teacher.provider == "local" and teacher.server is None and gen.server.gpus is not None:
        return ("teacher.server is null, so the teacher's server would take generation.server.gpus, the policy "
                "server's GPUs: set teacher.server (its gpus, or gpu_memory_utilization on a shared GPU)")
    policy = {gen.server.endpoint, gen.server.router.endpoint, *(gen.server.endpoints or [])} - {None}
    if teacher.provider == "external" and teacher.server.endpoint.rstrip("/") in {e.rstrip("/") for e in policy}:
        # the policy's server takes every weight push: a teacher there would score with the student's own weights
        return (f"teacher.server.endpoint {teacher.server.endpoint} is the policy's generation server, which receives "
                "the student's weights at every push, so the teacher would not be frozen: serve the teacher's weights "
                "on a server of their own")
    if teacher.provider == "local" and train.num_nodes > 1:
        return (f"teacher.provider 'local' with train.num_nodes {train.num_nodes}: after a resume each node would "
                "replace a stale teacher on its own; serve the teacher yourself and set teacher.provider: external")
    return None
