"""The weight path's own parts, below the servers and the training process that use them: weights as safetensors files
(:mod:`~grpo_steps.weights.files`), the update request every sender builds (:mod:`~grpo_steps.weights.update`),
evaluation's staging (:mod:`~grpo_steps.weights.staging`), the checked chain of versions in S3 (its reader
:mod:`~grpo_steps.weights.chain`, its publisher :mod:`~grpo_steps.weights.publisher`), every weight label
(:mod:`~grpo_steps.weights.labels`), the ``vllm serve`` flags that make a server load pushed weights
(:mod:`~grpo_steps.weights.server_flags`), and what the server does with them (checks:
:mod:`~grpo_steps.weights.layout`; loading: :mod:`~grpo_steps.weights.cpu_load`). Imports nothing at package import: the
vLLM worker extension (:mod:`grpo_steps.vllm_worker`, whose dotted name is a server flag and so stays at the package
root) imports these inside a server."""
