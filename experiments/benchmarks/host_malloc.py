"""SFT steps of the main job's model with glibc's default malloc vs `stepflash_jax.host.keep_freed_memory`.

    python experiments/benchmarks/host_malloc.py [--steps 10]       # ~2 minutes on 2 cores

malloc settings are per process and cannot be undone, so the script runs itself twice in subprocesses (default,
tuned), each compiling one SFT train step (configs/sft.py: 16 x 128 tokens, the tiny model, Muon) and timing
`--steps` steps; it prints wall, user and system seconds and minor page faults per step, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(steps: int) -> dict:
  import jax
  import numpy as np

  import stepflash_jax as sfj
  from stepflash_jax import model as model_lib
  from stepflash_jax.config import load_config_file
  from stepflash_jax.train import sft
  from stepflash_jax.train.step import frozen_mask, make_optimizer, lr_schedule

  c = load_config_file(os.path.join(ROOT, "configs", "sft.py"))
  args = model_lib.as_args(c.model)
  v = sfj.init(c.model, jax.random.key(0))
  tx = make_optimizer(c.optim, lr_schedule(c.optim.lr, c.train.steps))
  step = sft.make_train_step(args, tx, c.train, lambda s: c.optim.lr, frozen_mask(v["params"], True))
  state = {**v, "opt": tx.init(v["params"]), "step": jax.numpy.int32(0)}
  B, T = c.data.batch_size, c.data.seq_len
  tok = np.random.default_rng(0).integers(3, c.model.vocab_size, (B, T + 1)).astype(np.int32)
  batch = dict(
    tokens=tok[:, :-1],
    targets=tok[:, 1:],
    loss_mask=np.ones((B, T), np.float32),
    segment_ids=np.ones((B, T), np.int32),
    positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
  )
  state, _ = jax.block_until_ready(step(state, batch))  # compile
  r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  for _ in range(steps):
    state, _ = jax.block_until_ready(step(state, batch))
  r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
  per = lambda x: x / steps
  return dict(
    wall=per(wall),
    user=per(r1.ru_utime - r0.ru_utime),
    sys=per(r1.ru_stime - r0.ru_stime),
    faults=per(r1.ru_minflt - r0.ru_minflt),
  )


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--mode", choices=["default", "tuned"], default=None, help="internal: one measurement")
  a = ap.parse_args()
  if a.mode:
    if a.mode == "tuned":
      from stepflash_jax.host import keep_freed_memory

      assert keep_freed_memory(), "not glibc"
    print(json.dumps(measure(a.steps)))
    return
  res = {}
  for mode in ("default", "tuned"):
    out = subprocess.run([sys.executable, __file__, "--mode", mode, "--steps", str(a.steps)], capture_output=True)
    res[mode] = json.loads(out.stdout.decode().strip().splitlines()[-1])
  print(f"{'malloc':8s} {'wall s':>8s} {'user s':>8s} {'sys s':>8s} {'page faults':>12s}   (per SFT step)")
  for mode, r in res.items():
    print(f"{mode:8s} {r['wall']:8.3f} {r['user']:8.3f} {r['sys']:8.3f} {r['faults']:12.0f}")
  d, t = res["default"], res["tuned"]
  cpu = lambda r: r["user"] + r["sys"]
  print(f"default / tuned: wall {d['wall'] / t['wall']:.2f}x, CPU (user + sys) {cpu(d) / cpu(t):.2f}x")


if __name__ == "__main__":
  main()
