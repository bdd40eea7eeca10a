"""Python config files in the big_vision / ml_collections convention: `get_config(arg)`."""

from __future__ import annotations

import importlib.util


def load_config_file(path: str, arg: str | None = None):
  """Call `get_config(arg)` of a Python config file (the big_vision / ml_collections convention)."""
  spec = importlib.util.spec_from_file_location(f"_cfg_{abs(hash(path))}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg is not None else mod.get_config()
