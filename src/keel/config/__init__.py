"""Run configuration: schema, YAML loading with overrides, whole-config validation."""

from keel.config.load import apply_override, config_to_dict, load_config
from keel.config.schema import (
    DataConfig,
    DatasetConfig,
    DistributedConfig,
    FreezeConfig,
    FsdpConfig,
    LoraConfig,
    MethodConfig,
    ModelConfig,
    OutputConfig,
    RunConfig,
    TrainConfig,
    WandbConfig,
    WatchdogConfig,
)

__all__ = [
    "DataConfig",
    "DatasetConfig",
    "DistributedConfig",
    "FreezeConfig",
    "FsdpConfig",
    "LoraConfig",
    "MethodConfig",
    "ModelConfig",
    "OutputConfig",
    "RunConfig",
    "TrainConfig",
    "WandbConfig",
    "WatchdogConfig",
    "apply_override",
    "config_to_dict",
    "load_config",
]
