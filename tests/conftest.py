import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny_cfg():
  from stepflash_jax.config import load_config_file

  return load_config_file(os.path.join(ROOT, "configs", "model", "tiny.py"))
