"""Tables and plots of the mismatch lab (experiments/mismatch_lab.py): one row per run, rows grouped by variant
with "mean ± sd" over seeds, the headline comparisons, CSVs and PNG curves."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stepflash_jax.train.metrics import plot_metrics, read_jsonl, summary_table

CURVE_KEYS = [
  "reward",
  "accuracy",
  "actor_grad_norm",
  "kept_frac",
  "mis_token_keep_frac",
  "mis_traj_keep_frac",
  "entropy",
  "logp_abs_diff_mean",
  "logp_abs_diff_max",
  "confidence_rollout",
  "confidence_train",
  "kl",
]
TRUNC_KEYS = [
  "reward",
  "accuracy",
  "truncation_rate",
  "response_tokens",
  "value_mean",
  "actor_grad_norm",
  "entropy",
  "critic_loss",
  "eval/accuracy",
]
COLUMNS = [  # (table header, row key); the markdown table shows these, the CSVs hold every row key
  ("variant", "group"),
  ("seeds", "seeds"),
  ("gens", "gens"),
  ("N", "max_new_tokens"),
  ("gn mean", "gn_mean"),
  ("gn std", "gn_std"),
  ("gn std/mean", "gn_cv"),
  ("gn max", "gn_max"),
  ("reward first", "reward_first"),
  ("reward last", "reward_last"),
  ("acc SFT", "acc_before"),
  ("acc after", "acc_after"),
  ("tok keep", "token_keep"),
  ("traj keep", "traj_keep"),
  ("kept", "kept"),
  ("abs dlogp mean", "logp_diff_mean"),
  ("abs dlogp max", "logp_diff_max"),
  ("abs dlogp no replay", "logp_diff_noreplay"),
  ("flips", "flip_rate"),
  ("entropy first", "entropy_first"),
  ("entropy last", "entropy_last"),
  ("kl", "kl"),
  ("trunc", "trunc_rate"),
  ("conf rollout", "conf_rollout"),
  ("conf train", "conf_train"),
  ("min", "minutes"),
]
SD_KEYS = ("gn_mean", "gn_std", "reward_last", "acc_after")  # shown as "mean ± sd" when a group has > 1 seed


# ------------------------------------------------------------------------------------------- summaries
def _mean(rows, k, sl=slice(None)):
  vals = [r[k] for r in rows[sl] if k in r and r[k] is not None]
  return float(np.mean(vals)) if vals else float("nan")


def run_row(v: dict, workdir: str) -> dict:

  rd = os.path.join(workdir, "runs", v["name"])
  recs = [r for r in read_jsonl(os.path.join(rd, "rl", "metrics_rl.jsonl")) if "reward" in r]  # not gen 0
  with open(os.path.join(rd, "lab.json")) as f:
    meta = json.load(f)
  gn = np.array([r["actor_grad_norm"] for r in recs])
  q = max(1, len(recs) // 4)
  row = dict(
    name=v["name"],
    group=v["group"],
    objective=v["objective"],
    setting=v["setting"],
    seed=v["seed"],
    truncation=v["truncation"],
    max_new_tokens=meta["max_new_tokens"],
    gens=len(recs),
    gn_mean=float(gn.mean()),
    gn_std=float(gn.std()),
    gn_cv=float(gn.std() / max(gn.mean(), 1e-12)),
    gn_max=max(r.get("actor_grad_norm_max", r["actor_grad_norm"]) for r in recs),
    reward_first=_mean(recs, "reward", slice(0, q)),
    reward_last=_mean(recs, "reward", slice(-q, None)),
    acc_before=meta["accuracy_before"],
    acc_after=meta["accuracy_after"],
    token_keep=_mean(recs, "mis_token_keep_frac"),
    traj_keep=_mean(recs, "mis_traj_keep_frac"),
    kept=_mean(recs, "kept_frac") if v["objective"] in ("mispo", "gspo") else 1.0,
    logp_diff_mean=_mean(recs, "logp_abs_diff_mean"),
    logp_diff_max=max(r.get("logp_abs_diff_max", float("nan")) for r in recs),
    # with router replay: the mismatch the training pass would have without it (same samples); else = the above
    logp_diff_noreplay=_mean(
      recs, "logp_abs_diff_mean_noreplay" if meta["rl"].get("router_replay") == "always" else "logp_abs_diff_mean"
    ),
    flip_rate=_mean(recs, "flip_rate"),
    entropy_first=_mean(recs, "entropy", slice(0, q)),
    entropy_last=_mean(recs, "entropy", slice(-q, None)),
    kl=_mean(recs, "kl", slice(-q, None)),
    trunc_rate=_mean(recs, "truncation_rate"),
    conf_rollout=_mean(recs, "confidence_rollout"),
    conf_train=_mean(recs, "confidence_train"),
    minutes=meta["seconds"] / 60,
  )
  return row


def group_rows(rows: list[dict]) -> list[dict]:
  out = []
  for g in dict.fromkeys(r["group"] for r in rows):
    rs = [r for r in rows if r["group"] == g]
    row = {k: rs[0][k] for k in ("group", "objective", "setting", "truncation", "max_new_tokens")}
    row["seeds"] = len(rs)
    for k in [c for _, c in COLUMNS if c not in row and c != "seeds"]:
      vals = np.array([r[k] for r in rs], float)
      row[k] = float(vals.mean()) if k != "gn_max" else float(vals.max())
      if k in SD_KEYS:
        row[k + "_sd"] = float(vals.std(ddof=1)) if len(rs) > 1 else float("nan")
    out.append(row)
  return out


def markdown(groups: list[dict]) -> str:

  _fmt_num = lambda x: f"{x:.4g}"
  shown = []
  for g in groups:
    r = dict(g)
    for k in SD_KEYS:
      if g["seeds"] > 1:
        r[k] = f"{_fmt_num(g[k])} ± {_fmt_num(g[k + '_sd'])}"
    shown.append(r)
  return summary_table(shown, [c for _, c in COLUMNS], [h for h, _ in COLUMNS])


def write_csv(path, rows, keys=None):
  keys = keys or list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (list, dict))))
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, keys, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def _paired(rows, ga, gb, key):
  """[(seed, a, b)] of `key` for the seeds run in both groups (same seed = same prompts and sampling keys)."""
  a = {r["seed"]: r[key] for r in rows if r["group"] == ga}
  b = {r["seed"]: r[key] for r in rows if r["group"] == gb}
  return [(s, a[s], b[s]) for s in sorted(a) if s in b]


def headline(groups: list[dict], trunc: dict | None, rows: list[dict] = ()) -> list[str]:
  """The comparisons the report makes, in words, from the grouped rows (and per seed from the run rows)."""
  g = {r["group"]: r for r in groups}
  sd = lambda r, k: f" ± {r[k + '_sd']:.3g}" if r["seeds"] > 1 else ""
  out = []
  settings = dict.fromkeys(r["group"].split("/", 1)[1] for r in groups if "trunc" not in r["group"])
  for setting in settings:
    a, b = g.get(f"mispo/{setting}"), g.get(f"ppo/{setting}")
    if a and b:
      pairs = _paired(rows, a["group"], b["group"], "gn_std")
      per_seed = (
        f"; per seed MIS-PO/PPO {', '.join(f'{x / max(y, 1e-12):.2f}' for _, x, y in pairs)}" if len(pairs) > 1 else ""
      )
      out.append(
        f"- {setting}: actor grad-norm std MIS-PO {a['gn_std']:.3g}{sd(a, 'gn_std')} vs PPO "
        f"{b['gn_std']:.3g}{sd(b, 'gn_std')} (ratio {a['gn_std'] / max(b['gn_std'], 1e-12):.2f}{per_seed}; "
        f"std/mean {a['gn_cv']:.2f} vs {b['gn_cv']:.2f}; {a['seeds']} / {b['seeds']} seeds)"
      )
  for off in [r for r in groups if r["group"] + "/replay" in g]:
    on = g[off["group"] + "/replay"]
    out.append(
      f"- {off['group']}, router replay off vs on: expert flips of the training pass {off['flip_rate']:.4f} vs 0 "
      f"(replayed; {on['flip_rate']:.4f} of the replay runs' tokens would flip without it), abs dlogp "
      f"{off['logp_diff_mean']:.3g} vs {on['logp_diff_mean']:.3g} ({on['logp_diff_noreplay']:.3g} without replay "
      f"on the same samples), traj keep {off['traj_keep']:.2f} vs {on['traj_keep']:.2f}, gn std "
      f"{off['gn_std']:.3g}{sd(off, 'gn_std')} vs {on['gn_std']:.3g}{sd(on, 'gn_std')}, held-out "
      f"{off['acc_after']:.3f}{sd(off, 'acc_after')} vs {on['acc_after']:.3f}{sd(on, 'acc_after')} "
      f"({off['seeds']} / {on['seeds']} seeds)"
    )
  bo, ze = g.get("mispo/bf16/trunc-bootstrap"), g.get("mispo/bf16/trunc-zero")
  if bo and ze:
    diff = lambda k: ", ".join(f"{x - y:+.3f}" for _, x, y in _paired(rows, bo["group"], ze["group"], k))
    out.append(
      f"- truncation at N = {bo['max_new_tokens']} ({trunc['measured_rate']:.0%} of SFT samples cut; "
      f"{bo['trunc_rate']:.0%} / {ze['trunc_rate']:.0%} during RL): bootstrap vs zero: reward (last quarter) "
      f"{bo['reward_last']:.3f}{sd(bo, 'reward_last')} vs {ze['reward_last']:.3f}{sd(ze, 'reward_last')}, "
      f"held-out accuracy {bo['acc_after']:.3f}{sd(bo, 'acc_after')} vs {ze['acc_after']:.3f}"
      f"{sd(ze, 'acc_after')} (SFT {bo['acc_before']:.3f}), gn std {bo['gn_std']:.3g} vs {ze['gn_std']:.3g}; "
      f"per seed bootstrap - zero: accuracy {diff('acc_after')}, reward {diff('reward_last')}"
    )
  return out


def layer_table(probe_rows: list[dict]) -> str:
  """Per MoE layer: Sigma_k of the training pass over each engine's responses and the expert-flip rate against that
  engine, then per engine the correlation over layers of Sigma_k with the flip rate (markdown)."""
  rows = [r for r in probe_rows if r.get("layers")]
  if not rows:
    return ""
  names = list(rows[0]["layers"])
  table = [{"layer": n, f"Sigma_k ({rows[0]['setting']} samples)": rows[0]["layers"][n]["conf"]} for n in names]
  for r in rows:
    for t, n in zip(table, names):
      t[f"flips {r['setting']}"] = r["layers"][n]["flip"]
  cols = list(table[0])
  corr = []
  for r in rows:
    c, f = (np.array([r["layers"][n][k] for n in names]) for k in ("conf", "flip"))
    if c.std() > 0 and f.std() > 0:
      corr.append(f"{r['setting']} {np.corrcoef(c, f)[0, 1]:+.2f}")
  return summary_table(table, cols) + "\n\ncorr over layers (Sigma_k, flip rate): " + ", ".join(corr)


# ------------------------------------------------------------------------------------------- plots
def _mean_curves(workdir, names):
  """Per-step mean over the runs `names` of every numeric key."""

  by_step = {}
  for n in names:
    for r in read_jsonl(os.path.join(workdir, "runs", n, "rl", "metrics_rl.jsonl")):
      by_step.setdefault(r["step"], []).append(r)
  return [
    {"step": s, **{k: float(np.mean([r[k] for r in rs if k in r])) for k in rs[0] if k != "step"}}
    for s, rs in sorted(by_step.items())
  ]


def _curve_plots(workdir, vs) -> list[str]:
  """Mean learning curves per engine setting and per objective, and the truncation comparison."""
  out = []
  main = [v for v in vs if not v["name"].startswith("trunc-")]
  curves = {
    g: _mean_curves(workdir, [v["name"] for v in vs if v["group"] == g]) for g in dict.fromkeys(v["group"] for v in vs)
  }
  for setting in dict.fromkeys(v["setting"] for v in main):
    p = os.path.join(workdir, f"curves_setting_{setting}.png")
    plot_metrics(
      {g.split("/")[0]: curves[g] for g in curves if g.endswith(f"/{setting}")},
      CURVE_KEYS,
      p,
      title=f"objectives under the {setting} engine (mean over seeds)",
    )
    out.append(p)
  for obj in dict.fromkeys(v["objective"] for v in main):
    p = os.path.join(workdir, f"curves_objective_{obj}.png")
    plot_metrics(
      {g.split("/")[1]: curves[g] for g in curves if g.startswith(f"{obj}/") and "trunc" not in g},
      CURVE_KEYS,
      p,
      title=f"{obj} under each mismatch setting (mean over seeds)",
    )
    out.append(p)
  trunc_vs = [v for v in vs if v["name"].startswith("trunc-")]
  if trunc_vs:
    p = os.path.join(workdir, "truncation.png")
    plot_metrics(
      {v["name"]: read_jsonl(os.path.join(workdir, "runs", v["name"], "rl", "metrics_rl.jsonl")) for v in trunc_vs},
      TRUNC_KEYS,
      p,
      title="truncation-aware bootstrapping vs reward 0",
    )
    out.append(p)
  return out


def _probe_axes(fig, probe_rows):
  """Panels 2-3: Sigma_k against the engines' mismatch for the SFT policy (per setting and per response)."""
  ax = fig.add_subplot(1, 4, 2)
  x = [r["logp_diff_mean"] for r in probe_rows]
  ax.plot(x, [r["conf_train"] for r in probe_rows], "o-", label="training pass")
  ax.plot(x, [r["conf_rollout"] for r in probe_rows], "s--", label="rollout engine")
  for r in probe_rows:
    ax.annotate(r["setting"], (r["logp_diff_mean"], r["conf_train"]), fontsize=7)
  ax.set_xscale("log")
  ax.set_xlabel("mean |log pi_old - log pi_vllm|")
  ax.set_title("SFT policy: Sigma_k vs mismatch", fontsize=10)
  ax.legend(fontsize=7)
  ax = fig.add_subplot(1, 4, 3)
  for r in probe_rows:
    ax.scatter(r["per_seq_conf"], r["per_seq_dlogp"], s=8, label=f"{r['setting']} ({r['corr_conf_dlogp']:+.2f})")
  ax.set_yscale("log")
  ax.set_xlabel("response Sigma_k (training pass)")
  ax.set_ylabel("response mean |dlogp|")
  ax.set_title("per response (corr)", fontsize=10)
  ax.legend(fontsize=6)


def _runs_axes(ax, workdir, main):
  """Panel 4: per generation of every RL run, Sigma_k of the training pass against the mismatch."""
  for setting in dict.fromkeys(v["setting"] for v in main):
    pts = [
      (r["logp_abs_diff_mean"], r["confidence_train"])
      for v in main
      if v["setting"] == setting
      for r in read_jsonl(os.path.join(workdir, "runs", v["name"], "rl", "metrics_rl.jsonl"))
      if "logp_abs_diff_mean" in r
    ]
    if pts:
      ax.scatter(*zip(*pts), s=8, label=setting)
  ax.set_xscale("log")
  ax.set_xlabel("mean |dlogp| per generation")
  ax.set_ylabel("Sigma_k (training pass)")
  ax.set_title("RL runs: Sigma_k vs mismatch", fontsize=10)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)


def plots(workdir, vs, rows, probe_rows) -> list[str]:
  """The lab's PNGs: learning curves, and a grad-norm / routing-confidence summary (gradnorm_routing.png)."""
  out = _curve_plots(workdir, vs)
  fig = Figure(figsize=(17, 4.2), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 4, 1)
  groups = [r for r in group_rows(rows) if "trunc" not in r["group"]]
  ax.bar(
    range(len(groups)),
    [r["gn_std"] for r in groups],
    yerr=[0 if r["seeds"] < 2 else r["gn_std_sd"] for r in groups],
    color="tab:blue",
  )
  ax.set_xticks(range(len(groups)), [r["group"] for r in groups], rotation=70, fontsize=7)
  ax.set_title("actor grad-norm std over generations", fontsize=10)
  if probe_rows:
    _probe_axes(fig, probe_rows)
  _runs_axes(fig.add_subplot(1, 4, 4), workdir, [v for v in vs if not v["name"].startswith("trunc-")])
  fig.tight_layout()
  p = os.path.join(workdir, "gradnorm_routing.png")
  fig.savefig(p, format="png")
  return out + [p]
