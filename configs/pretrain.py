"""Pre-training of the tiny Step 3.5 Flash with a trained router (docs/training.md §3, scaled for a 2-core CPU).

  python experiments/run.py --config=configs/pretrain.py [--workdir=runs/pretrain]   # 9.1 min (Xeon, 2 cores)
  python experiments/run.py --config=configs/pretrain.py:small                        # smoke run
  python experiments/run.py --config=configs/pretrain.py:nobalance                    # balancing off (comparison)
The corpus is the task generators' problems with their worked solutions as plain text (no chat template), loss on
every token. The router trains (Muon) with aux-loss-free bias balancing (rate 0.001) and the EP-group balance loss
(0.001); MTP weight 0.3 (early pre-training). Logged per MoE layer and step: routing confidence Sigma_k, expert load
max / mean, bias norm (`routing/...` in metrics_pretrain.jsonl). SFT starts from it with `configs/sft.py:pretrained`.
Measured 2026-12-01 (Intel Xeon @ 2.00GHz, 2 cores, cold caches): 9 min 09 s wall, 13.7 CPU-minutes; Sigma_k 0.28 ->
0.595 and max / mean expert load 1.47 (means over MoE layers and the last 20 steps); `:nobalance` 0.66 and 2.60.
"""

from configs import sft as sft_config


def get_config(arg: str = ""):
  opts = sft_config.options(arg, ("small", "nobalance"))
  small = "small" in opts
  c = sft_config.get_config("small" if small else "")
  c.job = "pretrain"
  c.data.mixture = "default"
  c.train.steps = 40 if small else 250
  c.optim.lr = 3e-3  # the SFT peak: the toy model learns from scratch
  c.train.mtp_weight = 0.3  # report §4: 0.3 in early pre-training
  c.train.freeze_router = False  # the router trains (a Muon parameter) ...
  balance = "nobalance" not in opts
  c.train.router_bias_rate = 0.001 if balance else 0.0  # ... aux-loss-free bias balancing (report: 0.001) ...
  c.train.ep_balance_coef = 0.001 if balance else 0.0  # ... and the EP-group balance loss (report: 0.001)
  # G = 8 groups of one expert: the 8 experts on 8 expert-parallel devices (G = 1 makes the loss a constant; G = 4
  # left the last layer at max/mean load 1.96 against 1.47 on average with G = 8, 2026-12-01)
  c.train.ep_groups = 8
  # The router's LR relative to the rest: with 1x its confidence Sigma_k only reaches 0.38 in 250 steps (the report's
  # router trains for trillions of tokens); 3x 0.57, 4x 0.60 (docs/training.md §3)
  c.train.router_lr_scale = 4.0
  c.train.eval_every = c.train.steps  # pre-training has no accuracy eval; the field is the SFT trainer's
  c.train.checkpoint_every = 20 if small else 50
  return c
