"""The one typed config tree of a pipeline run (pydantic v2), validated once and never mutated.

Loaded from YAML by the flow's Metaflow ``Config`` (see :func:`parse_config`) or by
:func:`load_config` for the training entry point run on its own. Unknown keys and wrong types
are rejected with a message naming the key and how to fix it. One module per part of the tree: :mod:`.data`,
:mod:`.generation` (its server and router in :mod:`.serving`, its weight sync in :mod:`.weight_sync`),
:mod:`.training`, :mod:`.sections` (model, rewards, eval, registry, tracking, resources, schedule) and
:mod:`.pipeline` (the whole tree, the rules that span sections, loading); every public name is importable from
here.
"""

from grpo_steps.config.base import (  # noqa: F401
    COLOCATE_NEEDS_GPU,
    DEFAULT_CONFIG,
    INFRA_DIR,
    REPO_ROOT,
    ConfigError,
)
from grpo_steps.config.curriculum import POOLS, CurriculumConfig  # noqa: F401
from grpo_steps.config.data import (  # noqa: F401
    DEFAULT_SYSTEM_PROMPT,
    NATIVE_COLUMNS,
    RESERVED_COLUMNS,
    SOURCE_KEYS,
    DataConfig,
    FewShotExample,
    MixtureEntry,
    SourceConfig,
    kept_columns,
    split_counts,
)
from grpo_steps.config.generation import (  # noqa: F401
    CONSTRAINTS,
    SAMPLING_FILTERS,
    AsyncConfig,
    GenerationConfig,
    StructuredOutputsConfig,
    prefetch_depth,
)
from grpo_steps.config.pipeline import (  # noqa: F401
    PipelineConfig,
    load_config,
    optimizer_steps_per_generation,
    parse_config,
    validate_config,
)
from grpo_steps.config.sections import (  # noqa: F401
    SHARED_MOUNT,
    EvalConfig,
    ModelConfig,
    RegistryConfig,
    ResourcesConfig,
    RewardSpec,
    ScheduleConfig,
    TrackingConfig,
    TrainNodeResources,
    VLLMResources,
    on_shared_volume,
    parse_model_uri,
)
from grpo_steps.config.serving import RouterConfig, ServerConfig  # noqa: F401
from grpo_steps.config.teacher import TeacherConfig, teacher_refusal  # noqa: F401
from grpo_steps.config.training import (  # noqa: F401
    GRPO_ARGS_SET_BY,
    GRPO_KEYS_REPLACED,
    GRPO_KEYS_WITHOUT_EFFECT,
    IMPORTANCE_SAMPLING_LEVELS,
    LORA_RANKS,
    LOSS_TYPES,
    TRANSFORMERS_GENERATION_KEYS,
    TRL_VLLM_ONLY_KEYS,
    ImportanceSamplingLevel,
    LossType,
    PeftConfig,
    TrainConfig,
    grpo_key_owner_error,
)
from grpo_steps.config.weight_sync import (  # noqa: F401
    MISMATCH_MODES,
    ImportanceSamplingConfig,
    MismatchMode,
    S3SyncConfig,
    SyncCheckConfig,
)
