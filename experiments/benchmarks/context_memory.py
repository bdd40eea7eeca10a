"""Per-device memory of a training step with the sequence split over the context axis: context 1 vs 2 vs 4.

    python experiments/benchmarks/context_memory.py [--seq_len 8192] [--window 512]   # ~2 minutes on 2 cores

The toy model (configs/model/tiny.py, its 10 layers + 3 MTP modules, window set to 512 as in Step 3.5 Flash) on
one sequence of --seq_len tokens: forward + backward of the MTP-weighted loss, compiled (not run) on 1, 2 or 4
fake CPU devices that form the mesh's context axis. Prints XLA's memory analysis of the compiled program per
device: temporaries (activations kept for the backward pass, attention scores, gradients in flight), arguments
(parameters, replicated over context) and outputs (gradients). Full-attention layers with "ring" and
"all_gather" (model config context_full).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + os.environ.get("XLA_FLAGS", "")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from stepflash_jax import model as model_lib  # noqa: E402
from stepflash_jax import parallel  # noqa: E402
from stepflash_jax.config import load_config_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compiled_memory(seq_len: int, window: int, context: int, full: str) -> dict:
  """XLA's memory analysis (bytes per device) of the compiled forward + backward on a context-only mesh."""
  c = load_config_file(os.path.join(ROOT, "configs", "model", "tiny.py"))
  c.update(dict(sliding_window=window, context_full=full, max_position_embeddings=max(seq_len, 4096)))
  args = model_lib.as_args(c)
  params = model_lib.abstract_variables(args, "lm")
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)

  def loss(variables, tokens):
    out = model_lib.apply(args, variables, tokens, mtp=True)
    lse = lambda x: jnp.mean(jax.nn.logsumexp(x, axis=-1))
    return lse(out["logits"]) + 0.3 * sum(lse(m) for m in out["mtp_logits"])

  mesh = parallel.make_mesh(dict(data=1, fsdp=1, expert=1, context=context, tensor=1), jax.devices()[:context])
  with parallel.use_mesh(mesh, parallel.DEFAULT_RULES):
    m = jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis()
  return {"temp": m.temp_size_in_bytes, "args": m.argument_size_in_bytes, "out": m.output_size_in_bytes}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--seq_len", type=int, default=8192)
  p.add_argument("--window", type=int, default=512)
  a = p.parse_args()
  mib = lambda b: f"{b / 2**20:,.0f}"
  print(f"tiny model, T = {a.seq_len}, window {a.window}, one sequence, fp32; MiB per device\n")
  print("| context | full layers | temporaries | arguments | outputs | temporaries vs context 1 |")
  print("|---|---|---|---|---|---|")
  base = None
  for context, full in ((1, "ring"), (2, "ring"), (4, "ring"), (4, "all_gather")):
    r = compiled_memory(a.seq_len, a.window, context, full)
    base = base or r["temp"]
    name = full if context > 1 else "-"
    print(
      f"| {context} | {name} | {mib(r['temp'])} | {mib(r['args'])} | {mib(r['out'])} | {r['temp'] / base:.2f}x |",
      flush=True,
    )


if __name__ == "__main__":
  main()
