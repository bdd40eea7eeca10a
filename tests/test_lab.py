"""The mismatch lab's bookkeeping (experiments/mismatch_lab.py, configs/lab.py) against NumPy references.

No RL here (the notebooks test runs the small lab end to end): variant lists, the logged mismatch statistics, the
truncation limit, seed aggregation, the micro model config.
"""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import mismatch_lab as lab  # noqa: E402
from experiments import lab_report  # noqa: E402
from stepflash_jax.config import load_config_file, validate  # noqa: E402
from stepflash_jax.train.validate import validate_run_config  # noqa: E402


@pytest.fixture(scope="module")
def configs():
  return {a: load_config_file(os.path.join(ROOT, "configs", "lab.py"), a or None) for a in ("", "small")}


def test_configs_validate_and_share_one_batch_shape(configs):
  for c in configs.values():
    validate_run_config(c, num_devices=1)
    n = c.rl.prompts_per_step * c.rl.samples_per_prompt
    assert c.lab.probe_prompts * c.rl.samples_per_prompt == n == c.eval.batch_size  # one compiled engine
  small = configs["small"].model
  validate(small)
  assert small.num_layers == 4 and small.num_mtp_layers == 1 and small.moe_layers == [2, 3]
  assert len(small.layer_types) == len(small.rope_theta) == len(small.swiglu_limits) == 5
  assert small.layer_types[0] == "full_attention" and "sliding_attention" in small.layer_types[1:4]
  with pytest.raises(ValueError, match="unknown variant"):
    load_config_file(os.path.join(ROOT, "configs", "lab.py"), "huge")


def test_variants_full(configs):
  c = configs[""]
  vs = lab.variants(c, trunc_len=31)
  names = [v["name"] for v in vs]
  # 4 objectives x 3 settings x replay off / always, + 2 extra seeds x 4 cells, 2 truncation modes x 3 seeds
  assert len(names) == len(set(names)) == 4 * 3 * 2 + 2 * 4 + 2 * 3
  by = {v["name"]: v for v in vs}
  assert by["mispo-bf16-s0"]["rl"] == dict(objective="mispo", router_replay="off", rollout_dtype="bfloat16")
  assert by["tis-int8-replay-s0"]["rl"] == dict(
    objective="tis", router_replay="always", rollout_dtype="bfloat16", rollout_quantize="int8"
  )
  assert by["tis-int8-replay-s0"]["group"] == "tis/int8/replay"
  assert by["gspo-stale-s0"]["rl"]["max_staleness"] == c.lab.stale_steps
  for group, seeds in (("ppo/int8", {0, 1, 2}), ("mispo/int8/replay", {0, 1, 2}), ("ppo/int8/replay", {0})):
    assert {v["seed"] for v in vs if v["group"] == group} == seeds, group
  assert {v["seed"] for v in vs if v["group"] == "gspo/bf16"} == {0}
  t = by["trunc-zero-n31-s2"]
  assert t["rl"]["max_new_tokens"] == 31 and t["rl"]["truncation"] == "zero" and t["group"] == "mispo/bf16/trunc-zero"
  order = [v["name"] for v in sorted(vs, key=lab.run_priority)]
  assert order[:4] == ["mispo-int8-s0", "ppo-int8-s0", "trunc-bootstrap-n31-s0", "trunc-zero-n31-s0"]
  assert len(lab.variants(c, None)) == 32
  cfg = lab.variant_config(c, t, "/x/sft")
  assert (cfg.seed, cfg.rl.max_new_tokens, cfg.rl.truncation, cfg.rl.sft_workdir) == (2, 31, "zero", "/x/sft")
  assert c.rl.max_new_tokens == 64 and c.seed == 0  # the lab config itself is untouched
  assert c.pretrain.job == "pretrain" and c.train.freeze_router and c.rl.freeze_router  # SFT from pre-training
  for field, value in (("settings", "bf16,warp"), ("replay", "off,sometimes")):
    bad = c.copy_and_resolve_references()
    with bad.unlocked():
      bad.lab[field] = value
    with pytest.raises(ValueError, match=f"lab.{field}"):
      lab.variants(bad, None)


def test_truncation_limit():
  lengths = np.array([10, 20, 20, 30, 40, 50, 60, 64, 64, 64])
  truncated = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 1], bool)  # the last one did not end within 64
  # cut fraction at limit n: 0.5 for n in 40..49, 0.4 for 50..59, 0.3 for 60..63, 0.1 at 64; ties -> larger n
  assert lab.truncation_limit(lengths, truncated, 64, 0.25) == (63, 0.3)
  assert lab.truncation_limit(lengths, truncated, 64, 0.42) == (59, 0.4)
  assert lab.truncation_limit(lengths, truncated, 64, 0.0)[0] == 64  # nothing cut except the truncated one
  with pytest.raises(ValueError, match="lengths"):
    lab.truncation_limit(lengths[:3], truncated, 64, 0.2)


def test_group_rows_and_markdown():
  keys = [k for _, k in lab_report.COLUMNS if k not in ("group", "seeds", "max_new_tokens")]
  rng = np.random.default_rng(1)
  rows = []
  for g, seeds in (("mispo/bf16", 3), ("ppo/bf16", 1), ("mispo/noise", 2), ("ppo/noise", 2)):
    for s in range(seeds):
      r = dict(group=g, objective=g.split("/")[0], setting="bf16", truncation="bootstrap", max_new_tokens=64, seed=s)
      r.update({k: float(rng.uniform(0.1, 1)) for k in keys})
      rows.append(r)
  groups = lab_report.group_rows(rows)
  assert [g["group"] for g in groups] == ["mispo/bf16", "ppo/bf16", "mispo/noise", "ppo/noise"]
  assert [g["seeds"] for g in groups] == [3, 1, 2, 2]
  m = np.array([r["gn_std"] for r in rows[:3]])
  np.testing.assert_allclose(groups[0]["gn_std"], m.mean())
  np.testing.assert_allclose(groups[0]["gn_std_sd"], m.std(ddof=1))
  np.testing.assert_allclose(groups[0]["gn_max"], max(r["gn_max"] for r in rows[:3]))
  assert np.isnan(groups[1]["gn_std_sd"])
  md = lab_report.markdown(groups).splitlines()
  assert len(md) == 6 and "±" in md[2] and "±" not in md[3]
  head = lab_report.headline(groups, None, rows)
  assert len(head) == 2 and head[0].startswith("- bf16") and f"{groups[0]['gn_std']:.3g}" in head[0]
  assert "per seed" not in head[0]  # one common seed only
  ratios = [rows[4 + s]["gn_std"] / rows[6 + s]["gn_std"] for s in range(2)]  # paired by seed
  assert f"per seed MIS-PO/PPO {ratios[0]:.2f}, {ratios[1]:.2f}" in head[1]


def test_replay_headline_and_layer_table():
  keys = [k for _, k in lab_report.COLUMNS if k not in ("group", "seeds", "max_new_tokens")]
  rows = []
  for g in ("mispo/int8", "mispo/int8/replay"):
    r = dict(group=g, objective="mispo", setting="int8", truncation="bootstrap", max_new_tokens=64, seed=0)
    r.update({k: 0.5 for k in keys}, flip_rate=0.0 if "replay" in g else 0.0123)
    rows.append(r)
  head = lab_report.headline(lab_report.group_rows(rows), None, rows)
  assert any(
    h.startswith("- mispo/int8, router replay off vs on: expert flips of the training pass 0.0123 vs 0") for h in head
  )
  conf, flips = np.array([0.4, 0.55, 0.7]), np.array([0.03, 0.02, 0.004])
  layers = {f"layer_{i}": dict(conf=float(c), flip=float(f)) for i, (c, f) in enumerate(zip(conf, flips))}
  probe = [dict(setting="bf16", layers=layers), dict(setting="bf16+int8", layers=layers)]
  md = lab_report.layer_table(probe)
  assert md.count("layer_") == 3 and "flips bf16+int8" in md
  assert f"bf16 {np.corrcoef(conf, flips)[0, 1]:+.2f}" in md
  assert lab_report.layer_table([dict(setting="fp32")]) == ""
