import os
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
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="stepflash-test-xla-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


@pytest.fixture(scope="session")
def tiny_cfg():
  from stepflash_jax.config import load_config_file

  return load_config_file(os.path.join(ROOT, "configs", "model", "tiny.py"))
