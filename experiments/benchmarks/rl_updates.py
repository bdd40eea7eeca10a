"""One RL generation's updates at the main job's shapes: the actor's and the critic's mini-batch sequences one after
the other vs side by side (`parallel.concurrently`, what rl/trainer.py runs), and the three scoring programs; with
the config's rl.pack > 0, also packed vs unpacked sequences (docs/rl.md §1, step 8).

    python experiments/benchmarks/rl_updates.py [--reps 3] [--micro-batch N]  # ~8 minutes on 2 cores

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
from stepflash_jax.rl import packing
from stepflash_jax.rl.batches import minibatches
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.rl.programs import Programs
from stepflash_jax.train.step import frozen_mask, make_optimizer, warmup_constant
from timing import bench  # experiments/benchmarks/timing.py (the script's folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # configs/mispo.py imports configs.sft


def generation(n, P, R, vocab, rng):
  """A synthetic generation with the main job's lengths: left-padded prompts of 7-17 tokens (mean 12 of P = 20),
  responses of 12-43 tokens (mean 27.5 of R = 48)."""
  plen, rlen = rng.integers(7, min(P, 17) + 1, n), rng.integers(12, min(R, 43) + 1, n)
  mask = (np.arange(R)[None] < rlen[:, None]).astype(np.float32)
  prompt_seg = (np.arange(P)[None] >= (P - plen)[:, None]).astype(np.int32)
  tokens = rng.integers(3, vocab, (n, P + R)).astype(np.int32) * np.concatenate([prompt_seg, mask.astype(np.int32)], 1)
  pos = np.concatenate([np.maximum(np.arange(P)[None] - (P - plen)[:, None], 0), plen[:, None] + np.arange(R)], 1)
  f = lambda: rng.normal(-1.0, 0.3, (n, R)).astype(np.float32)
  return {
    "tokens": tokens,
    "positions": pos.astype(np.int32),
    "segment_ids": np.concatenate([prompt_seg, mask.astype(np.int32)], 1),
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
    if a.micro_batch:
      c.rl.pack = 0.0  # packed batches run as one pass
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
  kl = jnp.float32(rc.kl_coef)
  cases = {}
  for pack in sorted({0.0, rc.get("pack", 0.0)}, reverse=True):  # the config's first, then unpacked
    with parallel.use_mesh(mesh, rules):
      rp = rc.copy_and_resolve_references()
      rp.pack = pack
      fns = Programs(args, rp, actor_tx, critic_tx, P, frozen_mask(v["params"], rc.freeze_router))
      fns.compile(state, batch, (rc.actor_minibatches, rc.critic_minibatches), mesh, rules)
      amb = list(minibatches(batch, rc.actor_minibatches, np.random.default_rng(1), mesh, rules, pack))
      cmb = list(minibatches(batch, rc.critic_minibatches, np.random.default_rng(2), mesh, rules, pack))
    jb = jax.tree.map(jnp.asarray, packing.add(batch, pack))
    print(f"rl.pack = {pack}: {sum(map(packing.packed, amb + cmb))} of {len(amb + cmb)} mini-batches packed")

    def run(steps, s, mbs, *extra):
      for mb in mbs:
        s, _ = steps(s, mb, *extra)
      return jax.block_until_ready(s)

    actor = lambda fns=fns, amb=amb: run(fns.actor_step, state["actor"], amb, kl)
    critic = lambda fns=fns, cmb=cmb: run(fns.critic_step, state["critic"], cmb)
    scores = dict(
      actor=lambda fns=fns, jb=jb: fns.score(v["params"], v["router"], jb),
      ref=lambda fns=fns, jb=jb: fns.score(v["params"], v["router"], jb),
      values=lambda fns=fns, jb=jb: fns.values(cv["params"], cv["router"], jb),
    )
    tag = f" (pack {pack})"
    if pack == rc.get("pack", 0.0):
      cases["updates one after the other" + tag] = (lambda a=actor, c=critic: (a(), c()), ())
      cases["scoring one after the other" + tag] = (
        lambda sc=scores: [jax.block_until_ready(f()) for f in sc.values()],
        (),
      )
    cases["updates side by side" + tag] = (lambda a=actor, c=critic: parallel.concurrently(actor=a, critic=c), ())
    cases["scoring side by side" + tag] = (lambda sc=scores: parallel.concurrently(**sc), ())
  res = bench(cases, reps)
  print(f"{'case':44s} {'wall s (median)':>16s} {'CPU s':>8s}")
  for k, (wall, _, cpu) in res.items():
    print(f"{k:44s} {wall:16.2f} {cpu:8.2f}")
  f = rc.get("pack", 0.0)
  for what in ("updates", "scoring"):
    seq, par = res[f"{what} one after the other (pack {f})"][0], res[f"{what} side by side (pack {f})"][0]
    print(f"{what}: one after the other / side by side = {seq / par:.2f}x wall")
    if f:
      plain, packed = res[f"{what} side by side (pack 0.0)"], res[f"{what} side by side (pack {f})"]
      print(f"{what}: unpacked / packed = {plain[0] / packed[0]:.2f}x wall, {plain[2] / packed[2]:.2f}x CPU")


if __name__ == "__main__":
  main()
