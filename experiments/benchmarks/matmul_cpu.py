"""Matmul throughput of XLA:CPU (jax) against torch's CPU matmul on the dot shapes of the tiny model's train step.

    python experiments/benchmarks/matmul_cpu.py [--reps 30] [--xla_flags "..."]

Why it exists: the train step against the Hugging Face model (train_step_hf.py) is bound by its matmuls (~57% of the
op time is XLA's dot fusions, README), so the ceiling on that ratio is how fast each framework multiplies these
shapes. The shapes are the forward's dots at B=8 x T=256 (2048 tokens, hidden 256): the attention projections, the
dense and shared-expert FFN, one MoE layer's padded tiles (47 tiles of 128 rows, gate and up fused) and a small
per-expert matmul as HF's expert loop runs it (~256 tokens per expert). Each shape runs as one jitted dot in jax
and as torch.matmul in torch (set_num_threads(os.cpu_count())), each framework in its own subprocess, float32,
median of --reps round-robin calls (timing.bench) after a warm-up. Without torch it prints the jax column only.
Prints one line per shape and the geometric mean of the torch / jax throughput ratios; with --json, one JSON
object on the last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

from timing import bench  # experiments/benchmarks/timing.py (the script's folder is on sys.path)

# (name, batch, m, k, n): batch 0 = a plain 2-D matmul
SHAPES = (
  ("q proj (6 heads)", 0, 2048, 256, 384),
  ("o proj (6 heads)", 0, 2048, 384, 256),
  ("kv proj", 0, 2048, 256, 256),
  ("dense FFN up", 0, 2048, 256, 512),
  ("shared expert up", 0, 2048, 256, 128),
  ("shared expert down", 0, 2048, 128, 256),
  ("MoE tiles gate+up", 47, 128, 256, 256),
  ("MoE tiles down", 47, 128, 128, 256),
  ("one expert (HF loop)", 0, 256, 256, 128),
)


def operands(ones) -> dict:
  """{name: (lhs, rhs)} of each shape, made by `ones` (jnp.ones or torch.ones)."""
  out = {}
  for name, b, m, k, n in SHAPES:
    lead = (b,) if b else ()
    out[name] = (ones(lead + (m, k)), ones(lead + (k, n)))
  return out


def median_seconds(cases, reps: int) -> list[float]:
  """timing.bench's median wall seconds per case, in SHAPES order (torch tensors pass through its
  block_until_ready unchanged)."""
  return [t[0] for t in bench(cases, reps).values()]


def run_jax(reps: int) -> list[float]:
  import jax
  import jax.numpy as jnp

  f = jax.jit(jnp.matmul)
  return median_seconds({name: (f, xw) for name, xw in operands(jnp.ones).items()}, reps)


def run_torch(reps: int) -> list[float]:
  import torch

  torch.set_num_threads(os.cpu_count())
  return median_seconds({name: (torch.matmul, xw) for name, xw in operands(torch.ones).items()}, reps)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--xla_flags", default=None, help="XLA_FLAGS for the jax process, e.g. --xla_cpu_use_onednn=true")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a._worker:
    print(json.dumps((run_jax if a._worker == "jax" else run_torch)(a.reps)))
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if a.xla_flags is not None:
    env["XLA_FLAGS"] = a.xla_flags
  frameworks = ["jax"] + (["torch"] if importlib.util.find_spec("torch") else [])
  if len(frameworks) == 1:
    print("torch is not installed (pip install -e '.[hfbench]'): the jax column only")
  secs = {}
  for fw in frameworks:  # one process each: neither framework's thread pool competes with the other's
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", fw, "--reps", str(a.reps)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    secs[fw] = json.loads(p.stdout.strip().splitlines()[-1])
  gflops = {
    fw: [2 * max(b, 1) * m * k * n / t / 1e9 for (_, b, m, k, n), t in zip(SHAPES, s)] for fw, s in secs.items()
  }
  print(f"{'shape':24s} {'[batch,] m x k x n':>20s} " + " ".join(f"{fw + ' GFLOP/s':>14s}" for fw in frameworks))
  for i, (name, b, m, k, n) in enumerate(SHAPES):
    dims = (f"{b}, " if b else "") + f"{m} x {k} x {n}"
    print(f"{name:24s} {dims:>20s} " + " ".join(f"{gflops[fw][i]:14.1f}" for fw in frameworks))
  result = {"shapes": [s[0] for s in SHAPES], "gflops": gflops}
  if "torch" in gflops:
    ratios = [t / j for t, j in zip(gflops["torch"], gflops["jax"])]
    result["torch_over_jax_geomean"] = statistics.geometric_mean(ratios)
    print(
      f"torch / jax throughput: geometric mean {result['torch_over_jax_geomean']:.2f}x "
      f"(range {min(ratios):.2f}-{max(ratios):.2f}x)"
    )
  if a.json:
    print(json.dumps(result))


if __name__ == "__main__":
  main()
