"""Step 3.5 Flash at real widths and reduced depth on a GPU: a training step's tokens/s and MFU, and decode tokens/s.

  python experiments/benchmarks/gpu_model.py --out model.json     # on an H200: ~2-3 minutes, compiles included
  python experiments/benchmarks/gpu_model.py --small              # tiny widths on CPU: tests the script (~1 min)

Model: the released config (configs/model/step35_flash.py: hidden 4096, 64 / 96 query heads over 8 KV heads of
128, window 512, a dense FFN of 11,264 in layers 0-2, 288 experts top-8 of width 1,280 + a shared expert, vocab
128,896; bf16 weights and activations; norms, router, softmax and log-probs in fp32) cut to its first 4 layers
(`micro_model`: full + 3 SWA, 3 dense + 1 MoE) without MTP modules and without remat (4 layers fit).

1. Training step: the SFT step (`train.sft.make_train_step`: vocabulary-chunked next-token CE, grad, the guarded
   Muon update of configs/sft.py: Polar Express in fp16 for matrices, AdamW for embeddings and vectors), state
   donated, on `--batch` x `--seq` tokens; and the gradient alone (no optimizer), for each `--impls` entry
   ("attention_impl/moe_impl", or one name for both). MFU = model FLOPs / time / PEAK, model FLOPs = 6 * N *
   tokens + attention, N = the matmul parameters one token uses (count_params' "active" + the LM head), attention
   = 12 * Hq * D * (keys each query sees) per layer (fwd 4, bwd 8).
2. Decode: the rollout engine (bf16, temperature 1) at batch `--decode_batch`, `--prompt` prompt tokens,
   `--new_tokens` new tokens; tokens/s counts generated tokens (compile excluded, median of --reps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from configs.model.tiny import micro_model  # noqa: E402
from experiments.count_params import count  # noqa: E402
from stepflash_jax import model as M  # noqa: E402
from stepflash_jax.config import load_config_file  # noqa: E402
from stepflash_jax.config.defaults import FULL  # noqa: E402
from stepflash_jax.sampling import RolloutEngine  # noqa: E402
from stepflash_jax.train.sft import make_train_step, sft_loss  # noqa: E402
from stepflash_jax.train.step import frozen_mask, make_optimizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEAK = 790e12  # bf16 dense FLOP/s of an H200 as measured on this machine kind (an 8192^3 matmul, 769-798)


def model_cfg(small: bool, impl: str):
  name = "tiny.py" if small else "step35_flash.py"
  cfg = micro_model(load_config_file(os.path.join(ROOT, "configs", "model", name)), 4, 0)  # 4 layers, no MTP
  attention, moe = impl.split("/") if "/" in impl else (impl, impl)
  cfg.update(remat=False, attention_impl=attention, moe_impl=moe)
  return cfg


def model_flops(cfg, batch: int, seq: int) -> float:
  """Training FLOPs of one step (fwd + bwd) on batch x seq tokens, as in the module docstring."""
  c = count(cfg)
  head = cfg.vocab_size * cfg.hidden_size
  attn = 0
  for kind in cfg.layer_types[: cfg.num_layers]:
    w = seq if kind == FULL else min(cfg.sliding_window, seq)
    keys = sum(min(i + 1, w) for i in range(seq))
    heads = cfg.num_heads if kind == FULL else cfg.num_heads_swa
    attn += 12 * heads * cfg.head_dim * keys
  return batch * (6 * (c["active"] + head) * seq + attn)


def timed(fn, reps):
  """(median seconds, first call seconds incl. compile) of fn() -> pytree."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), first


def bench_train(cfg, batch, seq, reps):
  args = M.as_args(cfg)
  ocfg = load_config_file(os.path.join(ROOT, "configs", "sft.py")).optim
  tcfg = ml_collections.ConfigDict(dict(mtp_weight=0.0, ep_balance_coef=0.0, ep_groups=1, router_bias_rate=0.0))
  tx = make_optimizer(ocfg, 1e-4)
  variables = M.init(cfg, jax.random.key(0))
  params = variables["params"]
  state = {"params": params, "opt": tx.init(params), "router": variables["router"], "step": jnp.zeros((), jnp.int32)}
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 2, cfg.vocab_size, jnp.int32)
  data = {
    "tokens": tokens,
    "targets": jnp.roll(tokens, -1, axis=1),
    "loss_mask": jnp.ones((batch, seq), jnp.float32).at[:, -1].set(0.0),
    "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
    "segment_ids": jnp.ones((batch, seq), jnp.int32),
  }
  step = jax.jit(
    make_train_step(args, tx, tcfg, lambda s: 1e-4, frozen_mask(params, False)).__wrapped__, donate_argnums=0
  )
  grad = jax.jit(jax.grad(lambda p, r, b: sft_loss(p, r, b, args, 0.0)[0]))
  box = {"state": state}

  def run_step():
    box["state"], metrics = step(box["state"], data)
    return metrics["loss"]

  row = {"batch": batch, "seq": seq, "attention_impl": cfg.attention_impl, "moe_impl": cfg.moe_impl}
  flops = model_flops(cfg, batch, seq)
  for name, fn in (("step", run_step), ("grad", lambda: grad(box["state"]["params"], box["state"]["router"], data))):
    sec, first = timed(fn, reps)
    row[f"{name}_s"], row[f"{name}_first_s"] = round(sec, 4), round(first, 1)
    row[f"{name}_tokens_per_s"] = round(batch * seq / sec)
    row[f"{name}_mfu"] = round(flops / sec / PEAK, 4)
  row["loss"] = float(run_step())
  row["params"] = int(sum(x.size for x in jax.tree.leaves(box["state"]["params"])))
  row["model_tflop_per_step"] = round(flops / 1e12, 2)
  print("[train]", json.dumps(row), flush=True)
  return row


def bench_decode(cfg, batch, prompt, new_tokens, reps):
  engine = RolloutEngine(cfg, max_prompt_len=prompt, max_new_tokens=new_tokens, eos_id=1, pad_id=0, dtype="bfloat16")
  variables = M.init(cfg, jax.random.key(2))
  variables = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, variables)
  prompts = jax.random.randint(jax.random.key(3), (batch, prompt), 2, cfg.vocab_size, jnp.int32)
  lens = jnp.full((batch,), prompt, jnp.int32)
  out = {}

  def gen():
    out["o"] = engine.generate(variables, prompts, lens, jax.random.key(4))
    return out["o"]["response"]

  sec, first = timed(gen, reps)
  n = int(jnp.sum(out["o"]["lengths"]))
  row = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens, "generated": n, "generate_s": round(sec, 4)}
  row.update(first_s=round(first, 1), tokens_per_s=round(n / sec), impl=cfg.attention_impl)
  print("[decode]", json.dumps(row), flush=True)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny widths (CPU) to test the script")
  p.add_argument("--impls", default="pallas,xla/pallas", help="attention_impl[/moe_impl] values to time, in order")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--decode_batch", type=int, default=64, help="0: no decode measurement")
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new_tokens", type=int, default=256)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--budget_s", type=float, default=240.0, help="start no new measurement after this")
  p.add_argument("--out", default=None, help="write the results as JSON here")
  a = p.parse_args(argv)
  if a.small:
    a.batch, a.seq, a.decode_batch, a.prompt, a.new_tokens, a.reps = 2, 64, 4, 8, 8, 2
  start = time.perf_counter()
  res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "train": [], "decode": []}
  impls = a.impls.split(",")
  decode = [("decode", "xla")] if a.decode_batch > 0 else []
  jobs = [("train", impls[0])] + decode + [("train", impl) for impl in impls[1:]]
  for kind, impl in jobs:
    if time.perf_counter() - start > a.budget_s:
      print(f"[{kind}] budget reached, skipping impl={impl}", flush=True)
      continue
    cfg = model_cfg(a.small, impl)
    try:
      if kind == "train":
        res["train"].append(bench_train(cfg, a.batch, a.seq, a.reps))
      else:
        res["decode"].append(bench_decode(cfg, a.decode_batch, a.prompt, a.new_tokens, a.reps))
    except Exception as e:  # noqa: BLE001  (report and go on: one failure must not lose the other figures)
      print(f"[{kind}] impl={impl} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
      res[kind].append({"impl": impl, "error": f"{type(e).__name__}: {str(e)[:400]}"})
  res["seconds"] = round(time.perf_counter() - start, 1)
  print(f"done in {res['seconds']} s", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
