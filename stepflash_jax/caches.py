"""Where the project caches what it can rebuild: $STEPFLASH_CACHE, default ~/.cache/stepflash_jax.

tokenizer/   the locally trained SentencePiece models (data/tokenizer.py)
xla/         JAX's persistent compilation cache: a rerun (resume, another seed, another RL variant) loads compiled
             programs instead of compiling them again (~2-3 minutes of a cold main job on a 2-core CPU, ~9-10 of
             the pipeline's cold run). On CPU its keys name no directory: a copied or moved cache still hits.
             The compile-ahead helper (rl/warmup.py) compiles into a scratch `.ahead-*` directory of its own
             inside it and adds each whole entry as soon as JAX has written it (`share_when_written`); the job
             removes the scratch directory when the helper stops.
"""

import os
import shutil
import threading

# jax.monitoring events, both recorded in the compiling thread: the first just before JAX writes a new cache entry,
# the second when the compilation it belongs to (the write included) is over.
WRITE_EVENT = "/jax/compilation_cache/cache_misses"
COMPILED_EVENT = "/jax/core/compile/backend_compile_duration"


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


def share(src: str, dst: str) -> int:
  """Add to directory dst the compilation-cache entries of src that it lacks, each as a hard link (a copy where
  the file system has none) made under a temporary name and renamed: a reader of dst never sees part of an
  entry. Returns how many were added."""
  n = 0
  for name in sorted(os.listdir(src)):
    target = os.path.join(dst, name)
    if name.startswith(".") or not name.endswith("-cache") or os.path.exists(target):
      continue
    tmp = os.path.join(dst, f".{name}.{os.getpid()}.tmp")
    try:
      os.link(os.path.join(src, name), tmp)
    except OSError:
      shutil.copyfile(os.path.join(src, name), tmp)
    os.replace(tmp, target)
    n += 1
  return n


def share_when_written(src: str, dst: str) -> None:
  """From now on in this process, `share(src, dst)` each time a compilation ends while no thread is writing an
  entry (so only whole entries are shared, also with several compiling threads), instead of once at the end: a
  helper stopped before its last program still hands over every program it finished. Until a write event has
  been seen (a JAX that names its events otherwise) nothing is shared this way."""
  import jax

  lock, writing, written = threading.Lock(), set(), [0]  # threads writing now; entries written, not yet shared

  def on_event(event, **_):
    if event == WRITE_EVENT:
      with lock:
        writing.add(threading.get_ident())
        written[0] += 1

  def on_duration(event, _secs, **_):
    if event == COMPILED_EVENT:
      with lock:
        writing.discard(threading.get_ident())
        if written[0] and not writing:
          share(src, dst)
          written[0] = 0

  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
