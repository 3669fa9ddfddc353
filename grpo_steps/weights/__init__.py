"""The weight path's own parts, below the servers and the training process that use them: weights as safetensors
files (:mod:`~grpo_steps.weights.files`), the checked chain of versions in S3 (:mod:`~grpo_steps.weights.chain`), the
version label a server reports (:mod:`~grpo_steps.weights.labels`) and the ``vllm serve`` flags that make a server
load pushed weights (:mod:`~grpo_steps.weights.server_flags`). Imports nothing at package import: the vLLM worker
extension (:mod:`grpo_steps.vllm_worker`, whose dotted name is a server flag and so stays at the package root) imports
the chain inside a server."""
