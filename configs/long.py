"""RL on long reasoning: MIS-PO on 3-digit long multiplication, ~210-token worked responses.

  python experiments/run.py --config=configs/long.py [--workdir=runs/long]
  python experiments/run.py --config=configs/long.py:small                    # smoke run of every stage
Measured 2026-12-03 (Intel Xeon, 2 cores; starting from the pipeline's 150-step pre-training run through
--config.train.init_from=runs/pipeline/pretrain --config.pretrain.train.steps=150): SFT 500 steps at ~0.4 step/s
(~21 min alone), RL 13 min 05 s (16 generations of ~33 s); held-out 0.867 -> 0.961 on 256 3-digit problems.
Pre-training itself (configs/pretrain.py, 250 steps) takes ~9 min more on a fresh run.
The world of configs/mispo.py:pretrained (pre-training with a trained router, then SFT with it frozen), on the
`longmul` family (stepflash_jax/data/tasks/longmul.py): SFT on 2- and 3-digit problems (80-95 and 200-220 tokens),
RL and its held-out set on 3-digit ones only (`rl.mixture = "long"`), with a 256-token rollout budget. Trajectory
ratios (MIS-PO's geometric mean of pi_old / pi_vllm over the response) then span ~210 tokens instead of ~30, and the
response-length quantiles are logged per generation. README "Long reasoning" has the measured run.
"""

from configs import mispo


def get_config(arg: str = ""):
  if arg not in ("", "small"):
    raise ValueError(f"configs/long.py: unknown variant {arg!r} (use '' or 'small')")
  small = arg == "small"
  c = mispo.get_config("small,pretrained" if small else "pretrained")
  c.data.mixture = "longmul:2-3:1"  # SFT: the 2-digit traces teach the format at a third of the length
  c.data.seq_len = 256  # one 3-digit document (~220 tokens with its prompt) per row
  c.data.max_prompt_len = 12  # "Compute 347*286": <= 10 tokens
  c.train.steps = 60 if small else 500
  c.train.eval_every = c.train.steps
  c.eval.max_new_tokens = 256
  c.eval.num_examples = 16 if small else 256  # one sd of the accuracy estimate <= sqrt(.25 / 256) = 3.1 points
  c.eval.batch_size = 16 if small else 64
  r = c.rl
  r.mixture = "long"  # 3-digit x 3-digit problems only: correct responses need 200-220 tokens
  r.max_new_tokens = 256
  r.oversample = 1  # every sampled prompt: the 256-token rollouts are most of a generation here
  r.steps = 2 if small else 16
  r.prompts_per_step = 4 if small else 8
  r.samples_per_prompt = 4 if small else 8  # 64 responses x ~210 tokens per generation
  # the mismatch lab's LRs (configs/lab.py): 16 generations are too few for the main job's 3e-5 to move the policy
  r.actor_lr, r.critic_lr = 1e-4, 2.5e-4
  r.actor_minibatches = 2 if small else 4
  r.critic_minibatches = 4 if small else 8
  r.eval_every = r.steps
  r.log_every = 1 if small else 2
  r.checkpoint_every = r.steps if small else 4
  return c
