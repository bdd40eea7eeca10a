"""stepflash_jax.host.keep_freed_memory: freed large blocks are reused instead of being faulted in again."""

import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
  from stepflash_jax.host import keep_freed_memory
  assert keep_freed_memory()
x = np.ones(16 << 20)  # 128 MiB, freed below; warm-up
del x
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
  x = np.ones(16 << 20)
  del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_keep_freed_memory_stops_page_faults():
  faults = {m: int(subprocess.check_output([sys.executable, "-c", PROBE, m], text=True)) for m in ("default", "tuned")}
  # default glibc: each 128 MiB block is a fresh mmap, faulted in again on every iteration: at least 64 faults
  # per iteration even with 2 MiB transparent huge pages (32768 with 4 KiB pages); tuned: the block is reused
  assert faults["default"] >= 10 * 64, faults
  assert faults["tuned"] < 64, faults
