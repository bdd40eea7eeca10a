"""One RL generation's updates at the main job's shapes: the actor's and the critic's mini-batch sequences one after
the other vs side by side (`parallel.concurrently`, what rl/trainer.py runs), and the three scoring programs.

    python experiments/benchmarks/rl_updates.py [--reps 3] [--micro-batch N]  # ~4 minutes on 2 cores (compile ~90 s)

Shapes of configs/mispo.py: 192 responses of 20 prompt + 48 response tokens, 4 actor and 12 critic mini-batches,
the tiny model (configs/model/tiny.py) in float32, Muon. Prints wall and process CPU seconds per variant and the
ratios sequential / side by side (the results are identical: each program is deterministic).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import stepflash_jax as sfj
from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.config import load_config_file
from stepflash_jax.rl.batches import minibatches
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.rl.programs import Programs
from stepflash_jax.train.step import frozen_mask, make_optimizer, warmup_constant
from timing import bench  # experiments/benchmarks/timing.py (the script's folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # configs/mispo.py imports configs.sft


def generation(n, P, R, vocab, rng):
  """A synthetic generation: random prompt / response tokens, responses of random length."""
  lens = rng.integers(R // 4, R + 1, n)
  mask = (np.arange(R)[None] < lens[:, None]).astype(np.float32)
  tokens = rng.integers(3, vocab, (n, P + R)).astype(np.int32)
  f = lambda: rng.normal(-1.0, 0.3, (n, R)).astype(np.float32)
  return {
    "tokens": tokens,
    "positions": np.tile(np.arange(P + R, dtype=np.int32), (n, 1)),
    "segment_ids": np.concatenate([np.ones((n, P), np.int32), mask.astype(np.int32)], 1),
    "response": tokens[:, P:],
    "mask": mask,
    **{k: f() for k in ("logp_rollout", "logp_old", "logp_ref", "adv", "returns")},
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--micro-batch", type=int, default=None, help="rl.micro_batch (default: the config's)")
  a = ap.parse_args()
  reps = a.reps
  c = load_config_file(os.path.join(ROOT, "configs", "mispo.py"))
  if a.micro_batch is not None:
    c.rl.micro_batch = a.micro_batch
  print(f"rl.micro_batch = {c.rl.micro_batch}")
  rc, P, R = c.rl, c.data.max_prompt_len, c.rl.max_new_tokens
  n = rc.prompts_per_step * rc.samples_per_prompt
  args = model_lib.as_args(c.model)
  v = sfj.init(c.model, jax.random.key(0))
  actor_tx = make_optimizer(c.optim, warmup_constant(rc.actor_lr, rc.actor_warmup))
  critic_tx = make_optimizer(c.optim, warmup_constant(rc.critic_lr, rc.critic_warmup))
  cv = critic_from_actor(v)
  state = {
    "actor": {**v, "opt": actor_tx.init(v["params"])},
    "critic": {**cv, "opt": critic_tx.init(cv["params"])},
  }
  batch = generation(n, P, R, c.model.vocab_size, np.random.default_rng(0))
  mesh, rules = parallel.make_mesh(c.mesh), parallel.rules(c)
  with parallel.use_mesh(mesh, rules):
    fns = Programs(args, rc, actor_tx, critic_tx, P, frozen_mask(v["params"], rc.freeze_router))
    fns.compile(state, batch, (rc.actor_minibatches, rc.critic_minibatches), mesh, rules)
    amb = list(minibatches(batch, rc.actor_minibatches, np.random.default_rng(1), mesh, rules))
    cmb = list(minibatches(batch, rc.critic_minibatches, np.random.default_rng(2), mesh, rules))
  jb = jax.tree.map(jnp.asarray, batch)
  kl = jnp.float32(rc.kl_coef)

  def actor():
    s = state["actor"]
    for mb in amb:
      s, _ = fns.actor_step(s, mb, kl)
    return jax.block_until_ready(s)

  def critic():
    s = state["critic"]
    for mb in cmb:
      s, _ = fns.critic_step(s, mb)
    return jax.block_until_ready(s)

  scores = dict(
    actor=lambda: fns.score(v["params"], v["router"], jb),
    ref=lambda: fns.score(v["params"], v["router"], jb),
    values=lambda: fns.values(cv["params"], cv["router"], jb),
  )
  cases = {
    "updates one after the other": (lambda: (actor(), critic()), ()),
    "updates side by side": (lambda: parallel.concurrently(actor=actor, critic=critic), ()),
    "scoring one after the other": (lambda: [jax.block_until_ready(f()) for f in scores.values()], ()),
    "scoring side by side": (lambda: parallel.concurrently(**scores), ()),
  }
  res = bench(cases, reps)
  print(f"{'case':32s} {'wall s (median)':>16s} {'CPU s':>8s}")
  for k, (wall, _, cpu) in res.items():
    print(f"{k:32s} {wall:16.2f} {cpu:8.2f}")
  for what in ("updates", "scoring"):
    seq, par = res[f"{what} one after the other"][0], res[f"{what} side by side"][0]
    print(f"{what}: one after the other / side by side = {seq / par:.2f}x wall")


if __name__ == "__main__":
  main()
