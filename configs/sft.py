"""SFT of the tiny Step 3.5 Flash on the synthetic verifiable tasks (docs/training.md §2, scaled for a 2-core CPU).

  python experiments/run.py --config=configs/sft.py [--workdir=runs/sft]      # ~9 minutes on 2 idle cores
  python experiments/run.py --config=configs/sft.py:small                     # ~1 minute smoke run
Reruns of the same command resume from the latest checkpoint in the workdir.
"""

import os

import ml_collections

from stepflash_jax.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


OPTIONS = ("small", "pretrained")


def options(arg: str, allowed=OPTIONS) -> set:
  """The options after a config path ("small,pretrained" -> {"small", "pretrained"}); unknown ones are an error."""
  opts = set(filter(None, (arg or "").split(",")))
  if opts - set(allowed):
    raise ValueError(f"unknown config option(s) {sorted(opts - set(allowed))}; known: {list(allowed)}")
  return opts


def get_config(arg: str = ""):
  opts = options(arg)
  small = "small" in opts
  c = ml_collections.ConfigDict()
  c.job = "sft"
  c.seed = 0
  c.model = load_config_file(os.path.join(HERE, "model", "tiny.py"), "small" if small else None)  # small: 4 layers

  c.data = ml_collections.ConfigDict()
  c.data.mixture = "default"  # 2-4 digit arithmetic + 3-number countdown (stepflash_jax/data/tasks)
  c.data.batch_size = 16  # packed rows per step
  c.data.seq_len = 128  # a row holds ~2-3 documents of 40-70 tokens
  c.data.max_prompt_len = 32  # prompts are <= 24 tokens
  c.data.tokenizer_dir = ""  # "" = the package cache (~/.cache/stepflash_jax); trained on first use
  c.data.jsonl = ""  # a user's prompt file (stepflash_jax/data/jsonl.py) instead of the mixture; configs/custom.py

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-3  # toy model from scratch; the report's 1e-5 is for a pretrained 196B model
  c.optim.warmup_frac = 0.03  # report §5 (docs/training.md §2): 3% warmup ...
  c.optim.end_lr_frac = 0.5  # ... then cosine to half the peak (1e-5 -> 5e-6)
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0
  c.optim.muon_method = "polar_express"
  c.optim.ortho_dtype = "float16"  # StepFun: bf16 gave rare unrecoverable spikes
  # Polar Express safety factor 1.01 on every step of the published 6-step list ("reference": the paper's code and
  # StepFun's open training code); "last_step_unscaled" leaves the 6th step unscaled (an earlier reading)
  c.optim.pe_safety = "reference"

  c.train = ml_collections.ConfigDict()
  c.train.steps = 60 if small else 400  # held-out exact match: 50% after 250 steps, 76% after 500
  c.train.mtp_weight = 0.1  # report §4 (docs/training.md §2): 0.3 early pre-training, 0.1 in mid-training and SFT
  c.train.freeze_router = True  # SFT: router frozen ...
  c.train.router_bias_rate = 0.0  # ... and aux-loss-free bias balancing off (pre-training: 0.001)
  c.train.ep_balance_coef = 0.0  # EP-group balance loss off in SFT (pre-training: 0.001)
  c.train.ep_groups = 1
  c.train.router_lr_scale = 1.0  # the router's learning rate relative to the rest, when it trains (pre-training: 4)
  c.train.log_every = 10
  c.train.eval_every = 30 if small else 200
  c.train.checkpoint_every = 30 if small else 100
  c.train.keep_checkpoints = 2
  c.train.init_from = ""  # with a `pretrain` section: its run directory ("" = <workdir>/pretrain)

  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 32 if small else 128
  c.eval.batch_size = 32
  c.eval.max_new_tokens = 64  # answers are <= ~45 tokens
  c.eval.seed = 1234
  c.eval.dtype = "float32"  # numerics of the greedy eval engine ("bfloat16" = the rollout engine's)

  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1, context=1, tensor=1))
  if "pretrained" in opts:
    from configs import pretrain  # configs/pretrain.py builds on this file

    c.pretrain = pretrain.get_config("small" if small else "")
    c.pretrain.model = c.model  # one model, shared: an override of model.* changes pre-training's too
  return c
