"""Model configuration: the ConfigDict (defaults.py), its validation (checks.py), the hashable ModelArgs view the
modules are built from (args.py), the HF config.json mapping (hf_config.py), and config files with their
command-line overrides (files.py)."""

from stepflash_jax.config.args import LayerSpec, ModelArgs, model_args, rope_inv_freq, scan_plan
from stepflash_jax.config.checks import EXPERT_PARALLEL, ConfigError, parse_expert_parallel, validate
from stepflash_jax.config.defaults import FULL, IMPLEMENTATIONS, SWA, model_config, override
from stepflash_jax.config.files import keyword_fields, load_config_file, parse_flags
from stepflash_jax.config.hf_config import IMPL_KEYS, from_hf_config, to_hf_config

__all__ = [
  "ConfigError",
  "EXPERT_PARALLEL",
  "FULL",
  "IMPL_KEYS",
  "IMPLEMENTATIONS",
  "LayerSpec",
  "ModelArgs",
  "SWA",
  "from_hf_config",
  "keyword_fields",
  "load_config_file",
  "model_args",
  "model_config",
  "override",
  "parse_expert_parallel",
  "parse_flags",
  "rope_inv_freq",
  "scan_plan",
  "to_hf_config",
  "validate",
]
