"""The mismatch lab (docs/rl.md): MIS-PO, PPO, GSPO and TIS under controlled train/inference mismatch.

  python experiments/mismatch_lab.py --config=configs/lab.py [--workdir=runs/lab]        # ~1.5 h on 2 CPU cores
  python experiments/mismatch_lab.py --config=configs/lab.py:small --workdir=/tmp/lab    # ~3-5 min smoke run
  add --parts=probe (or probe,truncation, ...) to run only some of the parts below.

One SFT checkpoint (<workdir>/sft, trained once) is the start of every variant (rl.sft_workdir). Then:
  1. probe: one batch sampled from the SFT policy by each engine setting (fp32, bf16, bf16 with int8 / fp8 weights,
     bf16 + logit noise), scored by the fp32 training engine: |log pi_old - log pi_vllm| statistics, MIS keep
     fractions, routing confidence Sigma_k of the rollout and of the training pass, per response its Sigma_k against
     its mismatch, and per MoE layer Sigma_k against the expert-flip rate (lab_report.layer_table);
  2. truncation calibration: the response-length distribution of the SFT policy at rl.max_new_tokens gives the
     limit N that cuts ~lab.truncation_target of the responses (measured again at N);
  3. variants: short RL runs (experiments/run.py's trainer) for every objective x mismatch setting x router replay
     (lab.replay: off / always) x seed, and
     MIS-PO at the limit N with truncation-aware bootstrapping vs reward 0 (several seeds);
  4. lab_table.md/.csv (one row per variant group, seeds averaged, "mean ± sd" across seeds), lab_runs.csv (one row
     per run), PNG plots (curves overlaid per setting and per objective, grad norms, truncation, routing).
Every finished variant leaves <workdir>/runs/<name>/lab.json and is skipped on a rerun; an interrupted one resumes
from its checkpoint. XLA compilations are cached on disk (lab.compile_cache) so variants of one objective compile
once. For PPO and TIS, whose losses ignore pi_vllm, the MIS keep fractions are diagnostics (what MIS-PO would keep).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from experiments.lab_probe import probe, prompt_batches
from experiments.lab_report import group_rows, headline, layer_table, markdown, plots, run_row, write_csv
import jax

from stepflash_jax.caches import enable_compile_cache
from stepflash_jax.rl import trainer
from stepflash_jax.sampling import RolloutEngine
from stepflash_jax.train import sft
from stepflash_jax.train.metrics import summary_table
from stepflash_jax.train.validate import validate_run_config


def split(s, cast=str):
  return [cast(x.strip()) for x in str(s).split(",") if x.strip()]


def setting_overrides(lab, setting: str) -> dict:
  """The rl.* overrides of one mismatch setting (configs/lab.py)."""
  table = {
    "fp32": dict(rollout_dtype="float32"),
    "bf16": dict(rollout_dtype="bfloat16"),
    "noise": dict(rollout_dtype="bfloat16", logit_noise=float(lab.noise_scale)),
    "stale": dict(rollout_dtype="bfloat16", max_staleness=int(lab.stale_steps)),
    "int8": dict(rollout_dtype="bfloat16", rollout_quantize="int8"),
    "fp8": dict(rollout_dtype="bfloat16", rollout_quantize="fp8"),
  }
  if setting not in table:
    raise ValueError(f"config field 'lab.settings': unknown setting {setting!r}, known: {sorted(table)}")
  return table[setting]


def variants(config, trunc_len: int | None) -> list[dict]:
  """Every run of the lab: dict(name, group, objective, setting, seed, truncation, rl overrides)."""
  lab = config.lab
  seeds, extra = split(lab.seeds, int), split(lab.extra_seeds, int)
  multi = set(split(lab.multi_seed))
  out = []
  replays = split(lab.get("replay", "off"))
  bad = [r for r in replays if r not in ("off", "always")]
  if bad:
    raise ValueError(f"config field 'lab.replay': unknown mode(s) {bad}, known: off, always")
  for obj in split(lab.objectives):
    for setting in split(lab.settings):
      for replay in replays:
        parts = [obj, setting] + (["replay"] if replay == "always" else [])  # e.g. mispo/int8/replay
        for seed in seeds + (extra if ":".join(parts) in multi else []):
          out.append(
            dict(
              name="-".join(parts + [f"s{seed}"]),
              group="/".join(parts),
              objective=obj,
              setting=setting,
              seed=seed,
              truncation=config.rl.truncation,
              rl=dict(objective=obj, router_replay=replay, **setting_overrides(lab, setting)),
            )
          )
  if trunc_len:
    for mode in split(lab.truncation_modes):
      for seed in seeds + extra:
        out.append(
          dict(
            name=f"trunc-{mode}-n{trunc_len}-s{seed}",
            group=f"mispo/bf16/trunc-{mode}",
            seed=seed,
            objective="mispo",
            setting="bf16",
            truncation=mode,
            rl=dict(
              objective="mispo",
              rollout_dtype="bfloat16",
              truncation=mode,
              max_new_tokens=int(trunc_len),
              steps=int(lab.truncation_steps),
            ),
          )
        )
  return out


def run_priority(v: dict):
  """Run order: seed 0 of MIS-PO / PPO under int8, the truncation pair, the other int8 runs, the rest; then seeds."""
  trunc = v["name"].startswith("trunc-")
  rank = 0 if v["group"] in ("mispo/int8", "ppo/int8") else 1 if trunc else 2 if v["setting"] == "int8" else 3
  return (v["seed"], rank)


def variant_config(config, v: dict, sft_dir: str):
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.seed = v["seed"]
    c.rl.update(v["rl"])
    c.rl.sft_workdir = sft_dir
    c.rl.eval_every = c.rl.steps
    c.rl.checkpoint_every = min(c.rl.checkpoint_every, c.rl.steps)
  return c


def truncation_limit(lengths, truncated, max_new_tokens: int, target: float):
  """The limit n in [1, max_new_tokens] whose cut fraction is closest to `target` (ties: the larger n), and that
  fraction. A response of length L (EOS included) is cut at limit n iff L > n or it was cut at max_new_tokens.
  lengths int [B], truncated bool [B] (from one sample at max_new_tokens)."""
  lengths, truncated = np.asarray(lengths), np.asarray(truncated, bool)
  if lengths.shape != truncated.shape or lengths.ndim != 1:
    raise ValueError(f"lengths {lengths.shape} and truncated {truncated.shape} must be equal [B] shapes")
  cut = {n: float(np.mean((lengths > n) | truncated)) for n in range(1, int(max_new_tokens) + 1)}
  n = min(cut, key=lambda k: (abs(cut[k] - target), -k))
  return n, cut[n]


def calibrate_truncation(config, variables, tok, log=print) -> dict:
  """The limit N that cuts ~lab.truncation_target of the SFT policy's responses, measured again at N (bf16)."""

  rc, P = config.rl, config.data.max_prompt_len
  batches = prompt_batches(config, tok, config.seed + 2000)

  def sample(n):
    engine = RolloutEngine(
      config.model,
      max_prompt_len=P,
      max_new_tokens=n,
      eos_id=tok.eos_id,
      pad_id=tok.pad_id,
      dtype="bfloat16",
      temperature=rc.temperature,
      top_p=rc.top_p,
    )
    outs = [
      engine.generate(variables, b["tokens"], b["lengths"], jax.random.key(config.seed + 7 + i))
      for i, b in enumerate(batches)
    ]
    return (
      np.concatenate([np.asarray(o["lengths"]) for o in outs]),
      np.concatenate([np.asarray(o["truncated"]) for o in outs]),
    )

  lengths, trunc = sample(rc.max_new_tokens)
  n, cut = truncation_limit(lengths, trunc, rc.max_new_tokens, config.lab.truncation_target)
  _, trunc_n = sample(n)
  res = dict(
    target=float(config.lab.truncation_target),
    max_new_tokens=int(n),
    predicted_rate=cut,
    measured_rate=float(trunc_n.mean()),
    full_limit=int(rc.max_new_tokens),
    full_limit_rate=float(trunc.mean()),
    mean_len=float(lengths.mean()),
    responses=int(len(lengths)),
    length_quantiles={q: float(np.percentile(lengths, q)) for q in (50, 80, 90, 100)},
    lengths=lengths.tolist(),
    truncated_at_full_limit=trunc.tolist(),
  )
  log(
    f"lab truncation: limit {n} cuts {res['measured_rate']:.1%} of the SFT policy's responses "
    f"(predicted {cut:.1%}; {res['full_limit_rate']:.1%} at {rc.max_new_tokens})"
  )
  return res


# ------------------------------------------------------------------------------------------- the lab
def _cached_json(path, fn):
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  res = fn()
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  return res


PARTS = ("probe", "mismatch", "truncation")


PROBE_COLS = [
  "setting",
  "responses",
  "tokens",
  "logp_diff_mean",
  "logp_diff_p50",
  "logp_diff_p90",
  "logp_diff_p99",
  "logp_diff_max",
  "log_rho_mean",
  "token_keep",
  "traj_keep",
  "kept",
  "flip_rate",
  "conf_rollout",
  "conf_train",
  "conf_kept",
  "conf_filtered",
  "corr_conf_dlogp",
  "mean_len",
  "truncation_rate",
]
TABLE_NOTE = (
  "gn = actor gradient global norm (before clipping), per generation the mean over its actor mini-batches; "
  "std/max over generations. abs dlogp = |log pi_old - log pi_vllm| over valid response tokens (max: over "
  "generations of the mini-batch mean of the per-mini-batch max). tok/traj keep: the MIS filter (for PPO/TIS what "
  "it would keep). conf = routing confidence Sigma_k. reward first/last, entropy first/last: first/last quarter "
  "of the generations."
)


def _cached_part(path, run, compute):
  """The JSON result at path: computed (and written) when `run`, read when it exists, else None."""
  if run:
    return _cached_json(path, compute)
  return _cached_json(path, None) if os.path.exists(path) else None


def _run_variants(config, workdir, todo, sft_dir, log):
  """Train every variant of `todo` not finished yet (runs/<name>/lab.json marks a finished one)."""
  for i, v in enumerate(todo):
    rd = os.path.join(workdir, "runs", v["name"])
    if os.path.exists(os.path.join(rd, "lab.json")):
      continue
    log(f"lab: [{i + 1}/{len(todo)}] {v['name']}")
    t0 = time.time()
    cfg = variant_config(config, v, sft_dir)
    s = trainer.run(cfg, rd, log=lambda *a, **k: None)
    meta = dict(v, seconds=time.time() - t0, max_new_tokens=cfg.rl.max_new_tokens, **s)
    with open(os.path.join(rd, "lab.json"), "w") as f:
      json.dump(meta, f, indent=1)
    log(
      f"lab: {v['name']} done in {meta['seconds']:.0f}s: acc {s['accuracy_before']:.3f} -> "
      f"{s['accuracy_after']:.3f}, actor grad norm {s['actor_grad_norm_mean']:.3g} ± {s['actor_grad_norm_std']:.3g}"
    )


def _write_table(workdir, table, head, trunc, probe_md):
  with open(os.path.join(workdir, "lab_table.md"), "w") as f:
    f.write("# Mismatch lab\n\n" + table + "\n\n" + "\n".join(head) + "\n")
    if trunc:
      f.write("\nTruncation calibration: " + json.dumps({k: v for k, v in trunc.items() if not isinstance(v, list)}))
      f.write("\n")
    if probe_md:
      f.write("\n## Probe: SFT policy sampled by each engine, scored by the fp32 training engine\n\n" + probe_md + "\n")
    f.write("\n" + TABLE_NOTE + "\n")


def run_lab(config, workdir: str, log=print, parts=PARTS) -> dict:
  """Run (or resume) the lab into workdir; returns dict(table (markdown), groups, rows, probe, probe_table,
  truncation, headline, plots). `parts` selects what to run (the probe, the objective x setting variants, the
  truncation variants); the table and plots cover every variant of the config finished in workdir."""
  bad = [p for p in parts if p not in PARTS]
  if bad:
    raise ValueError(f"run_lab: unknown parts {bad}, known: {PARTS}")
  lab = config.lab
  t_start = time.time()
  if lab.get("compile_cache"):
    enable_compile_cache(lab.compile_cache)
  os.makedirs(workdir, exist_ok=True)
  sft_dir = lab.get("sft_workdir") or os.path.join(workdir, "sft")
  sft_out = sft.train(config, sft_dir, log=log)
  variables, tok = sft_out["variables"], sft_out["tokenizer"]
  log(
    f"lab: SFT checkpoint {sft_dir} (step {sft_out['step']}), held-out accuracy {sft_out['accuracy']['accuracy']:.3f}"
  )
  probe_rows = (
    _cached_part(
      os.path.join(workdir, "probe.json"),
      "probe" in parts and lab.probe_batches,
      lambda: probe(config, variables, tok, split(lab.probe_noise, float), log),
    )
    or []
  )
  trunc = _cached_part(
    os.path.join(workdir, "truncation.json"),
    "truncation" in parts and split(lab.truncation_modes) and lab.truncation_steps,
    lambda: calibrate_truncation(config, variables, tok, log),
  )
  vs = variants(config, trunc and trunc["max_new_tokens"])
  todo = [v for v in vs if ("truncation" if v["name"].startswith("trunc-") else "mismatch") in parts]
  _run_variants(config, workdir, sorted(todo, key=run_priority), sft_dir, log)  # headline comparisons first
  vs = [v for v in vs if os.path.exists(os.path.join(workdir, "runs", v["name"], "lab.json"))]
  rows = [run_row(v, workdir) for v in vs]
  groups = group_rows(rows)
  table = markdown(groups)
  head = headline(groups, trunc, rows)
  write_csv(os.path.join(workdir, "lab_runs.csv"), rows)
  write_csv(os.path.join(workdir, "lab_table.csv"), groups)
  probe_md = (
    summary_table(probe_rows, PROBE_COLS) + "\n\nPer MoE layer:\n\n" + layer_table(probe_rows) if probe_rows else ""
  )
  if probe_rows:
    write_csv(os.path.join(workdir, "probe.csv"), probe_rows, PROBE_COLS)
  png = plots(workdir, vs, rows, probe_rows)
  _write_table(workdir, table, head, trunc, probe_md)
  for line in ([table] if groups else []) + head:
    log(line)
  log(
    f"lab: done in {(time.time() - t_start) / 60:.1f} min; {os.path.join(workdir, 'lab_table.md')}, plots: "
    + ", ".join(os.path.basename(p) for p in png)
  )
  return dict(
    table=table,
    groups=groups,
    rows=rows,
    probe=probe_rows,
    probe_table=probe_md,
    truncation=trunc,
    headline=head,
    plots=png,
  )


def main(argv):
  del argv
  from absl import logging

  logging.set_verbosity(logging.WARNING)

  config = _CONFIG.value
  try:
    validate_run_config(config, num_devices=jax.device_count())
  except ValueError as e:
    sys.exit(f"error: {e}")
  bad = [p for p in _PARTS.value if p not in PARTS]
  if bad:
    sys.exit(f"error: --parts: unknown part(s) {bad}, known: {list(PARTS)}")
  workdir = _WORKDIR.value or os.path.join("runs", "lab")
  print(f"writing to {os.path.abspath(workdir)}", flush=True)
  run_lab(config, workdir, parts=tuple(_PARTS.value))


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  from stepflash_jax.config import keyword_fields, parse_flags

  _CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/lab.py, ':small' for the quick variant.", lock_config=True
  )
  _WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: runs/lab).")
  _PARTS = flags.DEFINE_list("parts", list(PARTS), "Parts of the lab to run (the tables cover what is finished).")
  flags.mark_flags_as_required(["config"])
  sys.argv = keyword_fields(sys.argv)
  app.run(main, flags_parser=parse_flags)
