"""Shared timing of the CPU benchmarks (run them as scripts: `python experiments/benchmarks/attention.py`)."""

import statistics
import time

import jax


def bench(cases, reps):
  """Round-robin timing (robust to load drift on a shared machine).

  Returns per case (median wall s, min wall s, median process CPU s); CPU time (all threads) is less
  sensitive than wall time to other jobs on a shared machine.
  """
  for fn, args in cases.values():
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm-up
  wall = {name: [] for name in cases}
  cpu = {name: [] for name in cases}
  for _ in range(reps):
    for name, (fn, args) in cases.items():
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return {n: (statistics.median(wall[n]), min(wall[n]), statistics.median(cpu[n])) for n in cases}
