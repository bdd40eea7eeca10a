import atexit
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# One persistent XLA cache for the session (set before JAX is imported): this process, the run.py subprocesses and
# the notebook kernels load a program another test already compiled (a new jit closure of the same computation, a
# rerun of the same config) instead of compiling it again. A fresh directory: nothing outside the session is reused.
# The two pytest-xdist workers (setup.cfg) share one accelerator: allocate its memory on demand, not 75% each.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The suite compiles far more than it runs: LLVM at -O1 without its expensive passes (the 8-device workers go to -O0)
# ran the pipeline's kill-and-resume test in 494 s against 577 s (2026-12-07, 2-core AMD EPYC). Numerics change
# with the generated code, as between machines; no test compares against a figure computed outside the suite.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="stepflash-test-xla-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
  # removed when the process that made it exits (pytest itself: its xdist workers inherit the variable and exit first)
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_cfg():
  from stepflash_jax.config import load_config_file

  return load_config_file(os.path.join(ROOT, "configs", "model", "tiny.py"))


def toy_generation(rng, P: int, R: int):
  """A 4-row RL generation for the programs' tests: left-padded prompts of 4 / 6 / 5 / 6 of P tokens, responses of
  3 / 8 / 5 / 1 of R tokens (rng draws the tokens); (prompts, rollout output) as `rl.batches.sequences` takes them."""
  import numpy as np

  lengths = np.array([4, 6, 5, 6], np.int32)
  tokens = rng.integers(4, 60, (4, P)).astype(np.int32)
  tokens[np.arange(P)[None] < (P - lengths)[:, None]] = 0  # left padding
  pos = np.clip(np.arange(P)[None] - (P - lengths)[:, None], 0, None).astype(np.int32)
  prompts = {"tokens": tokens, "positions": pos, "segment_ids": (tokens > 0).astype(np.int32), "lengths": lengths}
  mask = (np.arange(R)[None] < np.array([3, 8, 5, 1])[:, None]).astype(np.float32)
  gen = {"response": rng.integers(4, 60, (4, R)).astype(np.int32) * mask.astype(np.int32), "response_mask": mask}
  gen["logp"] = np.zeros((4, R), np.float32)
  return prompts, gen
