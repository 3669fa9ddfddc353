"""Development and test tooling, not used by a production run: the local S3 server (``local_s3``), the tiny random
test policy (``tiny_model``), a stand-in for the generation server (``stand_in_server``) and the admission policy's
evaluator (``admission``, on the development extra's CEL engine). Runtime modules import
from here only lazily, for the development-only model name ``embedded:tiny-random-qwen2``. Packaged with the flow as
part of ``grpo_steps`` (its ``METAFLOW_PACKAGE_POLICY`` covers subpackages; ``flows/grpo_flow.py package list``)."""
