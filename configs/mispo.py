"""The main job: SFT of the tiny Step 3.5 Flash, then RL with MIS-PO and a critic (docs/rl.md, toy scale).

  python experiments/run.py --config=configs/mispo.py            # 13 min on 2 cores (AMD EPYC, 2026-12-07), runs/mispo
  python experiments/run.py --config=configs/mispo.py:small      # ~3 minute smoke run of every stage
  python experiments/run.py --config=configs/mispo.py:pretrained # SFT from the pre-training stage (configs/pretrain.py)
configs/ppo.py and configs/gspo.py are this file with another objective (same budget, same seeds).
Measured 2026-12-07 (AMD EPYC with AVX2 only, 2 cores, fresh clone, fresh cache): 12 min 57 s, 22.1 CPU-minutes,
held-out exact match (1344 problems) 0.430 after SFT -> 0.545 after RL (+11.5); RL seeds 1 / 2 from that SFT checkpoint
+11.4 / +11.8, SFT seeds 1 / 2 (--config.seed) +11.4 / +14.3. Under other XLA code paths (flags as a proxy for other
CPUs) SFT ended at 0.35-0.44 and seeds 0 / 1 gained +20.6 / +17.0 and +13.6 / +18.8. The config before (250 SFT steps,
30 generations: --config.train.steps=250 --config.train.eval_every=250 --config.rl.steps=30) ends higher (0.60-0.65) and
its five runs gained +10.9 to +14.6 on that VM (12:45-13:01, 22.3-22.6 CPU-minutes), but its SFT ended at 0.43-0.58
depending on the code path, and the starts above ~0.55 gained only +9.4 / +9.7: RL stalls near 0.65-0.69 here. 300 SFT
steps and 36 generations before that: 0.68-0.69 at the end, +9.5 / +10.0 from SFT seeds 1 / 2.
Time, gain and their spread across machines and seeds: README, "The main job: time and variability"."""

import ml_collections

from configs import sft as sft_config


def _objective(r):
  """The policy loss's settings (report §5, docs/rl.md): MIS-PO's filters, the other objectives' clips, KL, GAE."""
  r.token_bounds = (0.5, 2.0)  # MIS-PO token filter on pi_old / pi_vllm (inclusive)
  r.traj_bounds = (0.996, 1.001)  # MIS-PO trajectory filter on the geometric-mean ratio (asymmetric)
  r.normalizer = "valid"  # divide by all valid response tokens (filtered ones included); or "kept"
  # rho averages log x_t over every valid response token, as the report's formula reads (open there); "kept": only
  # over the tokens inside token_bounds, so one far-off token does not filter its whole trajectory
  r.rho_tokens = "all"
  r.ppo_clip = 0.2
  r.gspo_clip = 1e-4
  r.tis_cap = 2.0
  r.kl_coef = 0.001  # unbiased KL to the SFT policy (final-stage coefficient)
  # generation (0-based) from which kl_coef applies: 0 = from the start (as here); the report switches the KL on
  # in its final RL stage only, e.g. kl_start = steps - 6 for the last 6 generations (the KL is logged throughout)
  r.kl_start = 0
  r.gamma = 1.0  # GAE gamma = lambda = 1: A_t = R - V(s_t)
  r.lam = 1.0
  r.truncation = "bootstrap"  # truncated responses get V(s_T); "zero" for the ablation


def _rl(small: bool):
  """The RL section: MIS-PO (report §5, docs/rl.md), its rollouts, critic, schedule and logging."""
  r = ml_collections.ConfigDict()
  r.objective = "mispo"  # "mispo" | "ppo" | "gspo" | "tis"
  r.mixture = ""  # RL prompts and held-out problems: "" = data.mixture (the SFT stage's)
  # generations; one epoch over each (~12 s each on 2 cores). 36 after SFT's 200 steps: five runs +11.4 to +14.3
  # (2026-12-07, AVX2 EPYC: +11.5 / +11.4 / +11.8 from one SFT checkpoint, +11.4 / +14.3 for SFT seeds 1 / 2); 30
  # gained +10.5 to +13.5 (README, "The main job: time and variability")
  r.steps = 4 if small else 36
  r.prompts_per_step = 8 if small else 24
  r.samples_per_prompt = 6 if small else 8  # report: 16 per reasoning prompt; 192 responses per generation here
  # Dynamic sampling (docs/rl.md §1, step 0; not in the report): the rollout samples oversample x prompts_per_step
  # prompts, the prompts_per_step whose rewards vary most are trained on; 1 = all. 2: +1.7 s per generation, +13.8 /
  # +13.4 points against +10.3 / +8.0 from one SFT checkpoint (README, "The main job: time and variability").
  r.oversample = 1 if small else 2
  r.actor_minibatches = 4  # report §5 (docs/rl.md §9): 4 actor and 12 critic mini-batches per generation
  r.critic_minibatches = 12
  # Rollout batching: 0 = the generation as one static batch; N = continuous batching with N slots (a finished row
  # takes the next prompt). It pays off when response lengths vary widely (3.4x on rollout.py's 16 / 256-token mix);
  # on this job's 20-43-token answers static is as fast (2026-12-01: 2.0 s vs 2.1-3.0 s per generation with 96-192).
  r.rollout_slots = 0
  # Rows per model pass (scoring, and each update's gradient accumulation; docs/rl.md §1.6); 0 = each batch in one
  # pass. Micro-batches bound memory at scale (experiments/benchmarks/rl_memory.py) and give the same update; at this
  # toy size on a CPU they only cost time (2026-12-01, 2 cores: updates 8.6 s per generation with 16 vs 7.0 s).
  r.micro_batch = 0
  # Sequence packing (docs/rl.md §1, step 8): every pass over the model runs on rows of 4 (P + R) slots holding
  # several sequences, ceil(pack * n / 4) rows for n sequences (a fraction of the unpacked slots; 0 = off). Prompts
  # average 12 of 20 tokens and responses 28 of 48 here, so 0.75 fits the 16-row critic mini-batches with room (one
  # that does not fit runs unpacked, compiled on first use; metric packed_frac). Same outputs as unpacked
  # (tests/test_packing.py); scoring -33%, updates -20% per generation (2026-12-04, AMD EPYC).
  r.pack = 0.75
  r.max_new_tokens = 48  # correct answers need <= 43 tokens; shrink (e.g. 24) to study truncation
  r.temperature, r.top_p = 1.0, 1.0  # report §5 (docs/rl.md §9)
  r.rollout_dtype = "bfloat16"  # the inference engine's numerics: the source of train/inference mismatch
  r.rollout_quantize = "none"  # or "int8" / "fp8": weight-only quantized rollout engine (more mismatch)
  r.logit_noise = 0.0  # extra Gaussian noise on rollout logits (mismatch lab knob)
  # Off-policy rollouts (docs/rl.md §10): generation j is sampled by the actor of generation j - max_staleness. With
  # async the rollout of generation j + 1 runs in a background thread while generation j trains (needs
  # max_staleness >= 1); without it the same stale rollouts run in turn (the mismatch lab's staleness knob). Off
  # here: on 2 CPU cores the rollout and the update share the cores (2026-12-02, experiments/benchmarks/rl_async.py:
  # 0.92x, identical metrics); it pays off when the rollout engine has devices of its own.
  r["async"] = False  # `async` is a Python keyword: r["async"] here, --config.rl.async=True on the command line
  r.max_staleness = 0
  _objective(r)
  r.reward = "rule"  # stepflash_jax.rl.rewards registry
  r.reward_filters = ()  # zero-reward filters applied first, e.g. ("format", "mixed_script") (docs/rewards.md)
  # {task family: reward} for the samples of those families (rewards.ByFamily; the pipeline's student gives the
  # preference domain its learned judge); empty = rl.reward for every sample
  r.family_rewards = ml_collections.ConfigDict()
  # Report §5 (docs/rl.md §9): actor 2e-6 / critic 5e-6 (ratio 2.5) with 20 / 50 warmup updates, after SFT at 1e-5.
  # Muon steps have a fixed size whatever the gradient's norm, and 48 responses per mini-batch are a noisy gradient:
  # the actor runs at 1/100 of the SFT peak. From one SFT checkpoint (0.574), 36 generations (2026-12-01):
  # actor 3e-5 -> +11.3 points, 5e-5 -> +11.4, 1e-4 -> +1.3 (drift: KL 0.07, arithmetic fell), 3e-4 -> -16 by gen 12.
  # From this config's starts (2026-12-07; nine runs: five on the VM's numerics, four under two proxies) 5e-5 was
  # better in four, equal in one, worse in four: mean +15.2 against +14.5, min +11.6 against +11.4: 3e-5 stays.
  r.actor_lr = 3e-5
  r.critic_lr = 7.5e-5
  r.actor_warmup = 20
  r.critic_warmup = 50
  r.freeze_router = True  # router weights frozen in RL as in SFT (switch for routing studies)
  # Router replay (docs/rl.md §8): "off" | "always" | "auto" = train on the rollout engine's experts when the
  # rollout's routing confidence Sigma_k < replay_threshold (0.5: twice the uniform router's k / E = 0.25 here)
  r.router_replay = "off"
  r.replay_threshold = 0.5
  r.sft_workdir = ""  # "" = <workdir>/sft; or an existing SFT run to start from
  r.compile_ahead = not small  # a niced helper compiles the eval's and RL's programs beside SFT (rl/warmup.py)
  r.log_every = 1 if small else 5
  r.eval_every = 4 if small else 12
  r.checkpoint_every = 2 if small else 10
  return r


def get_config(arg: str = ""):
  small = "small" in sft_config.options(arg)
  c = sft_config.get_config(arg)
  c.job = "rl"
  # A shorter SFT than configs/sft.py (400 steps) leaves RL room to improve: RL stalls near 0.65-0.69 here. 200 steps
  # end at 0.35-0.44 over the seeds and XLA code paths tried (2026-12-07, AVX2 EPYC), and every run then gained >= 11
  # points; 250 ended at 0.43-0.58 and the starts above ~0.55 gained < 10 (the docstring). (200 steps, then 10-12
  # generations at actor LR 1.5e-4 or 3e-4, gained +7 points by generation 5 and then collapsed below SFT.)
  c.train.steps = 60 if small else 200
  c.train.eval_every = c.train.steps  # evaluate once, at the end of SFT
  c.data.max_prompt_len = 20  # prompts of the default mixture are <= 19 tokens (longer ones: a clear error)
  # 1344 = 7 x 192 held-out problems: one sd of the accuracy estimate <= sqrt(.25 / 1344) = 1.4 points. The eval
  # engine has the rollout engine's numerics (bf16, 48 tokens); its 192-row decode program is not the rollout's
  # (384 rows with rl.oversample = 2): the compile-ahead helper compiles both beside SFT.
  c.eval.num_examples = 32 if small else 1344
  c.eval.batch_size = 48 if small else 192
  c.eval.dtype = "bfloat16"
  c.eval.max_new_tokens = 48

  c.rl = _rl(small)
  return c
