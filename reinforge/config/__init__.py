"""Typed configuration: schema, loading with overrides, and cross-field validation."""

from reinforge.config.loader import (
    ConfigError,
    config_to_dict,
    load_config,
    load_sft_config,
    load_structured,
    save_config,
    schema_keys,
)
from reinforge.config.schema import Config

__all__ = ["Config", "ConfigError", "config_to_dict", "load_config", "load_sft_config", "load_structured", "save_config",
           "schema_keys"]
