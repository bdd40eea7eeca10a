"""The mismatch lab (docs/rl.md): short RL runs from ONE SFT checkpoint under controlled train/inference mismatch.

  python experiments/mismatch_lab.py --config=configs/lab.py [--workdir=runs/lab]         # full: ~1.5 h here
  python experiments/mismatch_lab.py --config=configs/lab.py:small --workdir=/tmp/lab     # ~3-5 min
Measured 2026-12-03 on a 2-core Intel Xeon VM: ~2 min per RL variant when the machine is not shared (the 6
truncation runs: 12.5 min), 3-4 min when it is (the probe and 14 int8 runs beside a pipeline run: 46 min); the full
grid is 38 runs, plus pre-training (~9 min) and SFT (~6 min) unless lab.sft_workdir names a finished SFT run
(README's table: --config.lab.sft_workdir=runs/pipeline/sft). small: 4.7 min while another job shared the cores.
Rerunning the same command skips finished variants and resumes an interrupted one from its checkpoint. Outputs in the
workdir: lab_table.md / lab_table.csv (one row per variant group, seeds averaged, "mean ± sd" over seeds; the probe
table and the headline comparisons are in lab_table.md too), lab_runs.csv (one row per run), probe.csv, truncation.json
and PNG plots (curves overlaid per setting / per objective, grad-norm noise and routing confidence, truncation).

Knobs of the lab (`lab.*`); the RL knobs themselves are those of configs/mispo.py:
  objectives       the actor losses compared ("mispo,ppo,gspo,tis")
  settings         the mismatch settings, each a rollout engine: fp32 (the training numerics: no mismatch beyond
                   KV-cache / op-order differences), bf16 (the default engine), int8 / fp8 (bf16 with weight-only
                   quantized matrices), noise (bf16 + Gaussian logit noise of std `noise_scale`), stale (bf16
                   rollouts from the actor of `stale_steps` generations ago)
  replay           router replay modes run for every objective x setting: "off", "always" (rl.router_replay)
  seeds            seeds of every run; `multi_seed` lists the "objective:setting[:replay]" cells that also run
                   `extra_seeds` (those a conclusion rests on)
  truncation_*     MIS-PO (bf16) with rl.max_new_tokens shrunk until ~`truncation_target` of the SFT policy's
                   responses are cut (measured on `probe_prompts` x samples_per_prompt samples), for each mode in
                   `truncation_modes`; seeds = seeds + extra_seeds
  probe_*          the routing-confidence probe: one batch sampled from the SFT policy per engine setting
                   (fp32, bf16, bf16 with int8 / fp8 weights, bf16 + each noise in `probe_noise`), scored by the
                   training engine; per MoE layer Sigma_k against the expert-flip rate
The full lab's SFT starts from the pre-training stage (<workdir>/sft/pretrain, or train.init_from), whose router is
trained; SFT and RL then freeze it (report §5, docs/training.md §2). lab.sft_workdir may name any SFT run that
started from pre-training, e.g. the pipeline's: --config.lab.sft_workdir=runs/pipeline/sft (README's table).
The small lab keeps the router at its random init (Sigma_k 0.28).
"""

import ml_collections

from configs import mispo
from stepflash_jax.caches import cache_dir


def get_config(arg: str = ""):
  if arg not in ("", "small"):
    raise ValueError(f"configs/lab.py: unknown variant {arg!r} (use '' or 'small')")
  small = arg == "small"
  # The world (issue 13): full = SFT from the pre-training stage (configs/pretrain.py: router trained to Sigma_k
  # ~0.6, then frozen as in the report); small keeps the random-init router to stay within the test budget.
  c = mispo.get_config("small" if small else "pretrained")
  # The SFT checkpoint every variant starts from (<workdir>/sft, trained once).
  if small:  # (the 4-layer model of every small mode: configs/model/tiny.py)
    c.train.steps = c.train.eval_every = c.train.checkpoint_every = 30
  else:  # the measured lab: 300 SFT steps (~59% held-out), fp32 eval, 64-token limit
    c.train.steps = c.train.eval_every = 300
    c.data.max_prompt_len = 32
    c.eval.dtype, c.eval.max_new_tokens = "float32", 64
    # the LRs the lab table in README was measured with (the main job now runs its actor at 3e-5)
    c.rl.max_new_tokens, c.rl.actor_lr, c.rl.critic_lr = 64, 1e-4, 2.5e-4
  # One batch size (12 small / 24 full) for every engine call: RL rollouts, probe, eval share compiled programs.
  c.eval.num_examples = 12 if small else 96
  c.eval.batch_size = 12 if small else 24
  r = c.rl
  r.steps = 2 if small else 14  # generations per variant
  r.prompts_per_step = 3 if small else 6
  r.samples_per_prompt = 4
  r.oversample = 1  # the report's sampling: every sampled prompt is trained on
  r.actor_minibatches = 2 if small else 4
  r.critic_minibatches = 4 if small else 12
  r.eval_every = r.steps  # held-out accuracy once, after the last generation
  r.checkpoint_every = r.steps if small else 4
  r.log_every = 1 if small else 4

  c.lab = l = ml_collections.ConfigDict()
  l.objectives = "mispo,ppo" if small else "mispo,ppo,gspo,tis"
  # rollout engines (mismatch_lab.setting_overrides): bf16, int8 (bf16 with int8 weights, per-channel scales: what
  # production RL stacks serve rollouts with), stale; also fp32, fp8, noise
  l.settings = "int8" if small else "bf16,int8,stale"
  l.replay = "off,always"  # router replay off / always for every objective x setting (rl.router_replay)
  l.noise_scale = 0.5  # logit-noise std; on the SFT policy mean |dlogp| 0.0008 (bf16) -> 0.016 (+noise),
  # MIS trajectory keep 0.90 -> 0.42 (probe.md)
  l.stale_steps = 2  # rollouts from the actor of 2 generations ago
  l.seeds = "0"
  l.extra_seeds = "" if small else "1,2"
  # the cells the README's conclusions rest on (objective:setting[:replay]): MIS-PO vs PPO noise, GSPO's plateau,
  # what replay changes
  l.multi_seed = "" if small else "mispo:int8,ppo:int8,gspo:int8,mispo:int8:replay"
  l.truncation_modes = "bootstrap,zero"
  l.truncation_target = 0.2
  l.truncation_steps = r.steps
  l.probe_prompts = r.prompts_per_step  # x samples_per_prompt responses: the RL batch (same compiled engine)
  l.probe_batches = 1 if small else 2
  l.probe_noise = "" if small else "0.05,0.2,0.5,1.0"  # small: the quantized engines' compilations instead
  l.sft_workdir = ""  # "" = <workdir>/sft; or an SFT run of the same config to reuse
  # persistent XLA cache ("" = off): variants of one objective compile once, reruns start fast
  l.compile_cache = cache_dir("xla")
  return c
