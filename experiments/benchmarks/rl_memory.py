"""Compiled memory of the RL step against the generation size, and of full vs vocabulary-chunked log-probs.

    python experiments/benchmarks/rl_memory.py [--micro-batch 16] [--json]   # ~5 minutes on 2 cores (compiles only)

For generations of 64, 256 and 1024 responses (the main job's shapes otherwise: 20 prompt + 48 response tokens,
the tiny model, Muon; 4 actor and 4 critic mini-batches so every size divides) each RL program (scoring, values,
actor and critic mini-batch updates) is compiled on abstract shapes and XLA's peak is read from
`memory_analysis()`: arguments + outputs + temporaries - aliased. The step's peak is the largest of the four.
With rl.micro_batch rows per model pass the peak stays flat; "--micro-batch 0" (one pass per batch) shows the growth.
The log-prob rows are experiments/benchmarks/logprobs.py at the real vocabulary (128,896 x 4,096 tokens).
--json: the last line is {"responses": [...], "peak_bytes": [...], "logprob_full_bytes": N,
"logprob_chunked_bytes": M}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

import stepflash_jax as sfj
from stepflash_jax import model as model_lib
from stepflash_jax.config import load_config_file
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.rl.programs import Programs
from stepflash_jax.train.step import frozen_mask, make_optimizer, warmup_constant
from logprobs import temp_bytes  # experiments/benchmarks/logprobs.py (the script's folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # configs/mispo.py imports configs.sft
SIZES = (64, 256, 1024)
MINIBATCHES = 4  # actor and critic: divides every size


def peak(lowered) -> int:
  """XLA's peak bytes of a compiled program: arguments + outputs + temporaries - buffers shared in and out."""
  m = lowered.compile().memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def batch_shapes(n, P, R):
  """ShapeDtypeStructs of a generation of n rows as `batches.sequences` + scoring return it."""
  i32, f32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32))
  out = {k: i32(n, P + R) for k in ("tokens", "positions", "segment_ids")}
  out.update(response=i32(n, R), mask=f32(n, R))
  out.update({k: f32(n, R) for k in ("logp_rollout", "logp_old", "logp_ref", "adv", "returns")})
  return out


def step_peaks(c, n) -> dict:
  """{program: peak bytes} of one generation of n responses under config c."""
  rc, P, R = c.rl, c.data.max_prompt_len, c.rl.max_new_tokens
  args = model_lib.as_args(c.model)
  actor_tx = make_optimizer(c.optim, warmup_constant(rc.actor_lr, rc.actor_warmup))
  critic_tx = make_optimizer(c.optim, warmup_constant(rc.critic_lr, rc.critic_warmup))
  v = jax.eval_shape(lambda: sfj.init(c.model, jax.random.key(0)))
  cv = jax.eval_shape(critic_from_actor, v)
  actor = {**v, "opt": jax.eval_shape(actor_tx.init, v["params"])}
  critic = {**cv, "opt": jax.eval_shape(critic_tx.init, cv["params"])}
  fns = Programs(args, rc, actor_tx, critic_tx, P, frozen_mask(v["params"], rc.freeze_router))
  gen, mb = batch_shapes(n, P, R), batch_shapes(n // MINIBATCHES, P, R)
  return {
    "score": peak(fns.lower("score", v["params"], v["router"], gen, replay=False)),
    "values": peak(fns.lower("values", cv["params"], cv["router"], gen)),
    "actor_step": peak(fns.lower("actor_step", actor, mb, jnp.float32(0), replay=False)),
    "critic_step": peak(fns.lower("critic_step", critic, mb)),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--micro-batch", type=int, default=16, help="rl.micro_batch (0: one pass per batch)")
  ap.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
  a = ap.parse_args()
  c = load_config_file(os.path.join(ROOT, "configs", "mispo.py"))
  c.rl.micro_batch = a.micro_batch
  c.rl.actor_minibatches = c.rl.critic_minibatches = MINIBATCHES
  print(f"tiny model, {c.data.max_prompt_len} + {c.rl.max_new_tokens} tokens, rl.micro_batch {a.micro_batch} "
        f"({jax.default_backend()}); peak MiB per program:")  # fmt: skip
  peaks = []
  for n in SIZES:
    p = step_peaks(c, n)
    peaks.append(max(p.values()))
    print(f"  {n:5d} responses: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in p.items()))
  print(f"  largest / smallest step peak = {max(peaks) / min(peaks):.3f} (goal <= 1.10)")
  full = temp_bytes(4096, 128896, 256, "reference", None)
  chunked = temp_bytes(4096, 128896, 256, "chunked", 8192)
  print(f"log-probs, 4,096 tokens x vocab 128,896: full {full / 2**20:.0f} MiB, chunked {chunked / 2**20:.0f} MiB, "
        f"chunked / full = {chunked / full:.3f} (goal <= 0.125)")  # fmt: skip
  if a.json:
    print(
      json.dumps(
        {"responses": list(SIZES), "peak_bytes": peaks, "logprob_full_bytes": full, "logprob_chunked_bytes": chunked}
      )
    )


if __name__ == "__main__":
  main()
