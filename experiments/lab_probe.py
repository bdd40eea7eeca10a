"""The mismatch lab's probe (experiments/mismatch_lab.py, part 1): one batch sampled from the SFT policy by each
rollout-engine setting, scored by the fp32 training engine: |log pi_old - log pi_vllm| statistics, MIS keep fractions,
and the routing confidence Sigma_k of the rollout and of the training pass, per response and per MoE layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as model_lib
from stepflash_jax.data import prompt_dataset
from stepflash_jax.rl import losses, programs
from stepflash_jax.rl.batches import repeat_prompts, sequences
from stepflash_jax.sampling import RolloutEngine


def _sequence_scorer(args, prompt_len, temperature=1.0, top_p=1.0):
  """jit: (variables, batch) -> logp_old [B, R] (fp32 training engine), per-response routing confidence [B]
  (Sigma_k over the response tokens only: a pass over prompt + response minus a prompt-only pass, per sequence),
  and per MoE layer {layer: Sigma_k} over the response tokens and {layer: expert-flip rate} against the rollout."""

  def leaves(st, name):
    return jnp.stack(
      [
        v[0].reshape(())
        for p, v in jax.tree_util.tree_flatten_with_path(st, is_leaf=lambda x: isinstance(x, tuple))[0]
        if getattr(p[-1], "key", None) == name
      ]
    )  # [L]

  def one(variables, tokens, positions, seg):
    def run(s):
      _, st = model_lib.apply(args, variables, tokens[None], positions=positions[None], segment_ids=s[None], stats=True)
      return leaves(st, "confidence"), leaves(st, "tokens")

    c_all, n_all = run(seg)
    c_p, n_p = run(seg.at[prompt_len:].set(0))
    return jnp.mean((c_all * n_all - c_p * n_p) / jnp.maximum(n_all - n_p, 1.0))

  @jax.jit
  def score(variables, mb):
    head, st = programs.response_heads(args, variables, mb, prompt_len)
    conf = jax.vmap(one, in_axes=(None, 0, 0, 0))(variables, mb["tokens"], mb["positions"], mb["segment_ids"])
    logp, _ = programs.response_logp(head, mb["response"], temperature, top_p, entropy=False)
    per_layer = programs.response_confidence(st, mb["mask"], prompt_len)  # {MoE layer: Sigma_k}
    return logp, conf, per_layer, programs.flip_rates(args, st, mb, prompt_len)  # logp: the rollout's distribution

  return score


def prompt_batches(config, tok, seed):
  """lab.probe_batches fixed batches of lab.probe_prompts prompts x samples_per_prompt (the RL batch shape)."""

  it = iter(
    prompt_dataset(
      tok,
      batch_size=int(config.lab.probe_prompts),
      max_prompt_len=config.data.max_prompt_len,
      mixture=config.data.mixture,
      seed=seed,
    )
  )
  return [repeat_prompts(next(it), config.rl.samples_per_prompt) for _ in range(int(config.lab.probe_batches))]


def _probe_samples(engine, variables, batches, score, seed) -> list[dict]:
  """Sample every prompt batch with `engine`; score the responses with the fp32 training engine."""
  parts = []
  for i, prompts in enumerate(batches):
    gen = engine.generate(variables, prompts["tokens"], prompts["lengths"], jax.random.key(seed + i))
    batch = sequences(prompts, gen)
    logp_old, conf, layer_conf, flips = score(variables, {k: jnp.asarray(v) for k, v in batch.items()})
    parts.append(
      dict(
        logp_old=np.asarray(logp_old),
        conf=np.asarray(conf),
        layer_conf={k: float(v) for k, v in layer_conf.items()},
        flips={k: float(v) for k, v in flips.items()},
        mask=batch["mask"],
        logp_rollout=batch["logp_rollout"],
        truncated=np.asarray(gen["truncated"]),
        conf_rollout=float(gen["routing_confidence"]),
      )
    )
  return parts


def _probe_row(name, dtype, noise, parts, rc) -> dict:
  """Mismatch and routing-confidence statistics of one engine setting's samples."""
  cat = lambda k: np.concatenate([p[k] for p in parts])
  logp_old, conf, mask, logp_rollout = cat("logp_old"), cat("conf"), cat("mask"), cat("logp_rollout")
  keep, info = losses.mis_mask(
    jnp.asarray(logp_old), jnp.asarray(logp_rollout), jnp.asarray(mask), **programs.mis_args(rc)
  )
  diff = np.abs(logp_old - logp_rollout)
  ad = diff[mask > 0]
  per_seq = (diff * mask).sum(1) / np.maximum(mask.sum(1), 1)
  traj_ok = np.asarray(info["traj_ok"])
  corr = float(np.corrcoef(conf, per_seq)[0, 1]) if per_seq.std() > 0 and conf.std() > 0 else float("nan")
  layer_mean = lambda k: {n: float(np.mean([p[k][n] for p in parts])) for n in parts[0][k]}
  layers = {n: dict(conf=c, flip=layer_mean("flips").get(n, 0.0)) for n, c in layer_mean("layer_conf").items()}
  return dict(
    setting=name,
    dtype=dtype,
    noise=noise,
    responses=len(mask),
    tokens=int(mask.sum()),
    logp_diff_mean=float(ad.mean()),
    logp_diff_p50=float(np.percentile(ad, 50)),
    logp_diff_p90=float(np.percentile(ad, 90)),
    logp_diff_p99=float(np.percentile(ad, 99)),
    logp_diff_max=float(ad.max()),
    log_rho_mean=float(np.asarray(info["log_rho"]).mean()),
    token_keep=float(np.asarray(info["token_ok"]).sum() / mask.sum()),
    traj_keep=float(traj_ok.mean()),
    kept=float(np.asarray(keep).sum() / mask.sum()),
    conf_rollout=float(np.mean([p["conf_rollout"] for p in parts])),
    conf_train=float(conf.mean()),
    conf_kept=float(conf[traj_ok].mean()) if traj_ok.any() else float("nan"),
    conf_filtered=float(conf[~traj_ok].mean()) if (~traj_ok).any() else float("nan"),
    corr_conf_dlogp=corr,
    flip_rate=float(np.mean([v["flip"] for v in layers.values()])),
    layers=layers,
    truncation_rate=float(cat("truncated").mean()),
    mean_len=float(mask.sum(1).mean()),
    per_seq_conf=conf.tolist(),
    per_seq_dlogp=per_seq.tolist(),
  )


def probe(config, variables, tok, noises=(), log=print) -> list[dict]:
  """Sample from the SFT policy with each engine setting (fp32, bf16, bf16 with int8 / fp8 weights, bf16 + each
  logit noise std of `noises`); their mismatch and routing-confidence statistics, one row per setting."""
  rc, P = config.rl, config.data.max_prompt_len
  batches = prompt_batches(config, tok, config.seed + 1000)
  score = _sequence_scorer(model_lib.as_args(config.model), P, config.rl.temperature, config.rl.top_p)
  settings = [("fp32", "float32", 0.0, None), ("bf16", "bfloat16", 0.0, None)]
  settings += [(f"bf16+{q}", "bfloat16", 0.0, q) for q in ("int8", "fp8")]  # weight-quantized engines
  settings += [(f"bf16+noise{s:g}", "bfloat16", s, None) for s in noises]
  rows = []
  for name, dtype, noise, quantize in settings:
    engine = RolloutEngine(
      config.model,
      max_prompt_len=P,
      max_new_tokens=rc.max_new_tokens,
      eos_id=tok.eos_id,
      pad_id=tok.pad_id,
      dtype=dtype,
      temperature=rc.temperature,
      top_p=rc.top_p,
      logit_noise=noise,
      quantize=quantize,
    )
    rows.append(_probe_row(name, dtype, noise, _probe_samples(engine, variables, batches, score, config.seed), rc))
    r = rows[-1]
    log(
      f"lab probe {name:>16}: |dlogp| mean {r['logp_diff_mean']:.4f} p99 {r['logp_diff_p99']:.3f} | traj keep "
      f"{r['traj_keep']:.2f} | flips {r['flip_rate']:.4f} | Sigma_k rollout {r['conf_rollout']:.4f} train "
      f"{r['conf_train']:.4f} | "
      f"corr(Sigma_k, |dlogp|) {r['corr_conf_dlogp']:+.2f}"
    )
  return rows
