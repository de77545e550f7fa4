"""Typed configuration: dataclass sections, YAML files with `defaults:` composition, `--set` overrides.

A config file is YAML with optional `defaults: [other.yaml, model/flux-debug.yaml, ...]` (paths relative
to the file, then to the `configs/` folder). Defaults merge in order, the file's own keys last, then
`--set section.key=value` overrides (values parsed as YAML). Every key is checked against the dataclasses
of the sections: unknown keys, wrong types and impossible values raise ConfigError naming the key path. Each key's
field carries its help and the values it accepts (`setting`): validate checks them, and docs/config.md and
`--help-config` show them.

One module a job, each importing only those above it in this list:
- setting.py: a key's field (`setting`), the values it accepts, ConfigError
- job_sections.py, sections.py: the sections (the Slurm job's; the run's and `Config`, the whole)
- convert.py: a YAML tree into the sections, one converter per kind of type
- keys.py: the list of keys (validate's walk, `--help-config`, docs/config.md)
- rules.py: the cross-field checks (validate) and the values that follow from a config
- load.py: YAML files, `defaults:`, `--set`, and load_config, which runs them all
- flags.py: the `--set` and `--help-config` flags of the commands that read a config

Code outside the package imports from here (`from flux_train.config import load_config`), not from its modules.
"""

from flux_train.config.flags import PrintConfigKeys, add_overrides, assignment
from flux_train.config.job_sections import ContainerConfig, EnvConfig, PreflightConfig, SlurmConfig
from flux_train.config.keys import Key, keys, keys_help
from flux_train.config.load import CONFIG_DIR, apply_override, load_config, load_yaml, parse_yaml
from flux_train.config.rules import (
    accumulation_steps,
    checkpoint_dir,
    eval_interval_steps,
    graph_blocker,
    graphs_on,
    mesh_shape,
    validate,
)
from flux_train.config.sections import (
    EVAL_EVERY_SAMPLES,
    EVAL_SAMPLES,
    TARGET_VAL_LOSS,
    TRAIN_SAMPLES,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PerfConfig,
    TrainConfig,
)
from flux_train.config.setting import (
    AUTO_OR_POSITIVE,
    BELOW_ONE,
    PATCHABLE,
    POSITIVE,
    RULES,
    Accepts,
    ConfigError,
    setting,
)

__all__ = [
    "AUTO_OR_POSITIVE",
    "BELOW_ONE",
    "CONFIG_DIR",
    "EVAL_EVERY_SAMPLES",
    "EVAL_SAMPLES",
    "PATCHABLE",
    "POSITIVE",
    "RULES",
    "TARGET_VAL_LOSS",
    "TRAIN_SAMPLES",
    "Accepts",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ContainerConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "Key",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PerfConfig",
    "PreflightConfig",
    "PrintConfigKeys",
    "SlurmConfig",
    "TrainConfig",
    "accumulation_steps",
    "add_overrides",
    "apply_override",
    "assignment",
    "checkpoint_dir",
    "eval_interval_steps",
    "graph_blocker",
    "graphs_on",
    "keys",
    "keys_help",
    "load_config",
    "load_yaml",
    "mesh_shape",
    "parse_yaml",
    "setting",
    "validate",
]
