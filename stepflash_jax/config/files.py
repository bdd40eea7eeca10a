"""Python config files in the big_vision / ml_collections convention: `get_config(arg)`, and their command-line
overrides (--config.rl.steps=3) as the experiments/ scripts parse them."""

from __future__ import annotations

import importlib.util
import keyword
import re
import sys

from absl import flags


def load_config_file(path: str, arg: str | None = None):
  """Call `get_config(arg)` of a Python config file (the big_vision / ml_collections convention)."""
  spec = importlib.util.spec_from_file_location(f"_cfg_{abs(hash(path))}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg is not None else mod.get_config()


def keyword_fields(argv: list[str]) -> list[str]:
  """--config.rl.async=True -> --config.rl['async']=True: ml_collections parses an override's path as Python, where
  a keyword (`async`) is not a field name. (ml_collections reads sys.argv itself: rewrite it before app.run.)"""
  path = lambda m: "".join(f"['{k}']" if keyword.iskeyword(k) else f".{k}" for k in m[1].split(".")[1:])
  return [re.sub(r"^--(config(?:\.\w+)+)(?==)", lambda m: "--config" + path(m), a) for a in argv]


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`, with one line on stderr instead of a
  traceback for a --config file that is missing or raises, and for an override of a field the config does not have
  (--config.rl.stepz=3)."""
  lines = lambda e: [line.strip() for line in str(e).splitlines() if line.strip()]
  try:
    argv = flags.FLAGS(argv)
    if "config" in flags.FLAGS:  # a file that could not be loaded: ml_collections defers the error to a first use
      flags.FLAGS.config.get
  except flags.Error as e:  # ml_collections embeds the config file's traceback: its last line is the error
    first, *rest = lines(e)
    sys.exit(f"error: {first}" + (f" {rest[-1]}" if rest else ""))
  except OSError as e:  # that first use (an override, or the check above)
    sys.exit(f"error: --config: {lines(e)[-1]}")
  except (AttributeError, KeyError) as e:
    inner = e.args[0] if e.args else e  # ml_collections: AttributeError(KeyError("'stepz'\nDid you mean ...?"))
    first, _, hint = str(inner.args[0] if isinstance(inner, KeyError) and inner.args else inner).partition("\n")
    key = first.strip("'\"")
    path = lambda a: [k for k in re.split(r"[.\[\]']+", a.split("=", 1)[0]) if k]  # --config.rl['async']: keywords
    given = [path(a)[1:] for a in argv[1:] if a.startswith("--config.") and key in path(a)[1:]]
    if not given:  # not an override's field: a config file's own error
      raise
    field = ".".join(given[0][: given[0].index(key) + 1])
    sys.exit(f"error: config field {field!r} does not exist" + (f" ({hint})" if hint else ""))
  return argv
