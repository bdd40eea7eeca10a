"""How much router replay removes: expert flips and |log pi_old - log pi_vllm| per rollout engine, with and without
replay (docs/rl.md §8).

    python experiments/replay_probe.py --sft_workdir=runs/mispo/sft [--batches 2]     # ~3 minutes on 2 cores

Samples `--batches` x 192 responses from the SFT checkpoint (configs/mispo.py prompts, temperature 1) with each rollout
engine (fp32; bf16; bf16 with int8 / fp8 weights), then scores them in the fp32 training engine twice: on its own
top-k experts and replaying the rollout's. Prints, per engine: the flip rate (fed response tokens whose expert set
differs), mean and p99 |log pi_old - log pi_vllm| without and with replay, and the rollout's Sigma_k.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # configs/mispo.py imports configs.sft

from configs import mispo  # noqa: E402
from stepflash_jax import model as model_lib  # noqa: E402
from stepflash_jax import parallel  # noqa: E402
from stepflash_jax.data import prompt_dataset  # noqa: E402
from stepflash_jax.rl.batches import repeat_prompts, sequences  # noqa: E402
from stepflash_jax.rl.programs import Programs, fed_mask  # noqa: E402
from stepflash_jax.sampling import RolloutEngine  # noqa: E402
from stepflash_jax.train import sft  # noqa: E402
from stepflash_jax.train.step import frozen_mask  # noqa: E402

ENGINES = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "bf16+int8": ("bfloat16", "int8")}
ENGINES["bf16+fp8"] = ("bfloat16", "fp8")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sft_workdir", required=True, help="a finished SFT run (e.g. runs/mispo/sft)")
  ap.add_argument("--batches", type=int, default=2)
  a = ap.parse_args(argv)
  c = mispo.get_config()
  out = sft.train(c, a.sft_workdir, log=lambda *_: None)
  tok, v = out["tokenizer"], {k: out["variables"][k] for k in ("params", "router")}
  args, P, rc = model_lib.as_args(c.model), c.data.max_prompt_len, c.rl
  fns = Programs(args, rc, None, None, P, frozen_mask(v["params"], True))
  prompts = iter(prompt_dataset(tok, batch_size=rc.prompts_per_step, max_prompt_len=P, mixture=c.data.mixture, seed=7))
  batches = [repeat_prompts(next(prompts), rc.samples_per_prompt) for _ in range(a.batches)]
  print(f"{'engine':<10} {'flips':>7} {'|dlogp| mean':>13} {'replayed':>9} {'p99':>9} {'replayed':>9} {'Sigma_k':>8}")
  for name, (dtype, quant) in ENGINES.items():
    eng = RolloutEngine(
      c.model, max_prompt_len=P, max_new_tokens=rc.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
      dtype=dtype, quantize=quant,
    )  # fmt: skip
    rows = {"flips": [], "own": [], "rep": [], "conf": []}
    for i, pb in enumerate(batches):
      gen = parallel.to_host(eng.generate(v, pb["tokens"], pb["lengths"], jax.random.key(i)))
      mb = {k: jax.numpy.asarray(x) for k, x in sequences(pb, gen).items()}
      own, _, _, flips = fns.score(v["params"], v["router"], mb)
      rep = fns.score(v["params"], v["router"], mb, replay=True)[0]
      m = np.asarray(mb["mask"]) > 0
      rows["own"].append(np.abs(np.asarray(own) - gen["logp"])[m])
      rows["rep"].append(np.abs(np.asarray(rep) - gen["logp"])[m])
      n = float(np.asarray(fed_mask(mb["mask"])).sum())
      rows["flips"].append((float(np.mean([float(x) for x in flips.values()])), n))
      rows["conf"].append(float(gen["routing_confidence"]))
    own, rep = np.concatenate(rows["own"]), np.concatenate(rows["rep"])
    flips = sum(f * n for f, n in rows["flips"]) / max(sum(n for _, n in rows["flips"]), 1)
    print(
      f"{name:<10} {flips:7.4f} {own.mean():13.2e} {rep.mean():9.2e} {np.quantile(own, 0.99):9.2e} "
      f"{np.quantile(rep, 0.99):9.2e} {np.mean(rows['conf']):8.4f}"
    )


if __name__ == "__main__":
  main()
