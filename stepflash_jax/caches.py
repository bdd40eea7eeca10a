"""Where the project caches what it can rebuild: $STEPFLASH_CACHE, default ~/.cache/stepflash_jax.

tokenizer/   the locally trained SentencePiece models (data/tokenizer.py)
xla/         JAX's persistent compilation cache: a rerun (resume, another seed, another RL variant) loads compiled
             programs instead of compiling them again (~2-3 minutes of a cold main job on a 2-core CPU, ~9-10 of
             the pipeline's cold run). On CPU its keys name no directory: a copied or moved cache still hits.
"""

import os


def cache_dir(name: str) -> str:
  root = os.environ.get("STEPFLASH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "stepflash_jax"))
  return os.path.join(root, name)


def enable_compile_cache(path: str | None = None) -> str:
  """Turn on JAX's persistent compilation cache at `path` and return it. Default: the cache JAX is already set up
  with (JAX_COMPILATION_CACHE_DIR), else cache_dir("xla")."""
  import jax

  if path is None and jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = os.path.expanduser(path or cache_dir("xla"))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  if jax.default_backend() == "cpu":
    # JAX also points XLA's GPU autotuning cache into `path`, and that path is part of every program's cache key:
    # a cache copied or moved elsewhere would never hit. CPU programs have no autotuning to cache.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
  return path
