"""Overlapped generation (rl.async) against the same stale rollouts sampled in turn: seconds per generation.

    python experiments/benchmarks/rl_async.py [--generations 8] [--staleness 1]   # ~6 minutes on 2 cores

Two RL runs of configs/mispo.py:small from one SFT checkpoint, both with rl.max_staleness = s (generation j is
sampled by the actor of generation j - s): one samples each generation when it is needed, the other samples it in
a background thread while the previous generation trains (docs/rl.md §1 step 7). Prints each run's wall seconds
per generation (the first generation, which compiles, left out), the ratio, the seconds training waited for
rollouts, and whether the two runs' metrics are identical (they must be). On a small CPU the rollout and the
update share the cores, so the overlap gains little; on an accelerator the rollout engine would have its own
devices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("reward", "actor_loss", "actor_grad_norm", "critic_loss", "kl", "kept_frac", "staleness")


def rl_run(workdir, sft_dir, generations, staleness, overlap):
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "run.py"),
    "--config=" + os.path.join(ROOT, "configs", "mispo.py:small"),
    f"--workdir={workdir}",
    f"--config.rl.steps={generations}",
    "--config.rl.eval_every=1000",  # no held-out evals between generations
    "--config.rl.checkpoint_every=1000",
    f"--config.rl.max_staleness={staleness}",
    f"--config.rl.async={overlap}",
    f"--config.rl.sft_workdir={sft_dir}",
  ]
  subprocess.run(cmd, check=True, capture_output=True, text=True)
  with open(os.path.join(workdir, "rl", "metrics_rl.jsonl")) as f:
    return [r for r in map(json.loads, f) if "reward" in r]


def seconds(rows, key=None):
  """Summed stage seconds (or one stage's) of the generations after the first."""
  return sum(v for r in rows[1:] for k, v in r.items() if k.startswith("time/") and (key is None or k == key))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--generations", type=int, default=8)
  p.add_argument("--staleness", type=int, default=1)
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    sft = os.path.join(tmp, "sync", "sft")  # the first run trains SFT; the second reuses it
    rows = {
      mode: rl_run(os.path.join(tmp, mode), sft, a.generations, a.staleness, mode == "async")
      for mode in ("sync", "async")
    }
  n = a.generations - 1
  per = {m: seconds(r) / n for m, r in rows.items()}
  wait = {m: seconds(r, "time/rollout") / n for m, r in rows.items()}
  same = all(x[k] == y[k] for x, y in zip(rows["sync"], rows["async"]) for k in COMPARED)
  print(f"{n} generations after the first, rl.max_staleness={a.staleness}, configs/mispo.py:small")
  for m in ("sync", "async"):
    sample = sum(r["rollout_sample_s"] for r in rows[m][1:]) / n
    print(f"  {m:5s}: {per[m]:6.2f} s per generation (waiting for rollouts {wait[m]:5.2f} s; rollouts {sample:5.2f} s)")
  print(f"async / sync speed: {per['sync'] / per['async']:.2f}x   identical metrics: {same}")


if __name__ == "__main__":
  main()
