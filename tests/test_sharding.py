"""Sharding: meshes + rules, expert parallelism, sharded Muon, SFT / MIS-PO actor / critic steps and rollout on
8 fake CPU devices, compared with one device.

The multi-device checks run in ONE subprocess (tests/sharding_worker.py: XLA_FLAGS set before jax is imported,
fast-compile XLA flags) so the rest of the suite keeps its single device; the tests below assert on its JSON
report. Regenerate the golden PartitionSpecs with
    UPDATE_GOLDEN=1 python -m pytest tests/test_sharding.py -k golden
"""

import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharding_worker import MESHES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
TOL = 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Tests (in the pytest process: one device)


@pytest.fixture(scope="module")
def report():
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  t = time.time()
  r = subprocess.run(
    [sys.executable, os.path.join(ROOT, "tests", "sharding_worker.py")],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    cwd=ROOT,
  )
  lines = [l for l in r.stdout.splitlines() if l.startswith("REPORT ")]
  assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-6000:]
  rep = json.loads(lines[-1][len("REPORT ") :])
  rep["wall"] = time.time() - t
  print(f"sharding worker: {rep['wall']:.0f} s")
  return rep


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("kind", ["sft", "actor", "critic"])
def test_step_on_mesh_matches_one_device(report, mesh_name, kind):
  r = report[mesh_name][kind]
  assert abs(r["loss"] - r["loss_ref"]) <= TOL * max(1.0, abs(r["loss_ref"])), r
  assert r["state_maxdiff"] <= TOL, r  # params, optimizer state, router bias, step
  assert r["metrics_maxdiff"] <= 1e-4, r  # grad norms, keep fractions, kl, confidence, ...
  assert r["sharding_kept"], r  # the new state comes out with the state shardings


def test_sft_step_changes_parameters(report):
  """Guard against a vacuous comparison: the step moved the parameters and the MIS-PO filter dropped a row."""
  assert report["single_sft"]["skipped"] == 0.0
  assert report["single_sft"]["grad_norm"] > 0
  assert 0 < report["single_actor"]["kept_frac"] < 1


def test_expert_parallel_strategies_match_single_device(report):
  ep = dict(report["ep"])
  assert ep.pop("ragged:1.9_max_rows_received") <= 46  # that case really ran the exchange, not the fallback
  assert len(ep) == 6
  for name, r in ep.items():
    assert r["y"] <= 1e-5 and r["grad"] <= 1e-5, (name, r)


def test_local_attention_matches_single_device(report):
  assert report["attention"]["y"] <= 1e-5 and report["attention"]["grad"] <= 1e-5, report["attention"]


def test_pallas_attention_runs_per_device_in_the_model(report):
  r = report["pallas_model"]
  assert r["logits"] <= 1e-5 and r["grad"] <= 1e-5 and r["attention_gathers"] == 0, r


def test_muon_orthogonalises_experts_where_they_live(report):
  assert report["muon"]["data2_expert4"]["collectives"] == 0, report["muon"]
  assert report["muon"]["fsdp2_expert2_tensor2"]["full_stack_collectives"] == 0, report["muon"]


def test_rollout_on_mesh(report):
  assert report["rollout"]["tokens_equal"], report["rollout"]
  assert report["rollout"]["logp_maxdiff"] <= 1e-4, report["rollout"]


def test_sharded_init(report):
  r = report["init"]
  assert r["values_maxdiff"] == 0.0 and r["sharding_kept"] and r["opt_sharding_kept"], r
  assert r["opt_leaves_sharded"] > 0, r


# ---------------------------------------------------------------------------------------------------------------
# Single-process tests: rules, golden specs, mesh config errors, batch axes


def _golden(cfg_file):
  sys.path.insert(0, ROOT)
  from stepflash_jax import model as model_lib
  from stepflash_jax import parallel
  from stepflash_jax.config import load_config_file
  import jax

  cfg = load_config_file(os.path.join(ROOT, "configs", "model", cfg_file))
  out = {}
  for head in ("lm", "value"):
    logical = model_lib.logical_axes(cfg, head)
    mesh_spec = parallel.mesh_specs(logical, parallel.DEFAULT_RULES)
    flat_l = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[
      0
    ]
    flat_m = jax.tree.leaves(mesh_spec, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, l), m in zip(flat_l, flat_m):
      key = head + ":" + "/".join(str(getattr(p, "key", p)) for p in path)
      out[key] = f"{tuple(l)} -> {tuple(m)}"  # logical names -> mesh axes per dimension
  return out


@pytest.mark.parametrize("cfg_file", ["tiny.py", "step35_flash.py"])
def test_golden_partition_specs(cfg_file):
  path = os.path.join(GOLDEN, "partition_specs_" + cfg_file.replace(".py", ".json"))
  got = _golden(cfg_file)
  if os.environ.get("UPDATE_GOLDEN"):
    os.makedirs(GOLDEN, exist_ok=True)
    with open(path, "w") as f:
      json.dump(got, f, indent=1, sort_keys=True)
  with open(path) as f:
    want = json.load(f)
  assert got == want


def test_golden_has_expected_entries():
  with open(os.path.join(GOLDEN, "partition_specs_step35_flash.json")) as f:
    g = json.load(f)
  assert (
    g["lm:params/blocks/sub_0/moe/gate_proj/kernel"]
    == "('layers', 'expert', 'embed', 'mlp') -> (None, 'expert', 'fsdp', 'tensor')"
  )
  assert (
    g["lm:params/blocks/sub_0/attn/q_proj/kernel"]
    == "('layers', 'embed', 'heads', 'head_dim') -> (None, ('fsdp', 'expert'), 'tensor', None)"
  )
  assert g["lm:router/blocks/sub_0/moe/router_bias"] == "('layers', 'expert') -> (None, 'expert')"
  assert g["value:params/value_head/kernel"] == "('embed',) -> (('fsdp', 'expert'),)"
  assert len([k for k in g if k.startswith("lm:")]) > 100


def test_resolve_precedence_and_divisibility():
  from jax.sharding import PartitionSpec as P
  from stepflash_jax import parallel

  R = parallel.DEFAULT_RULES
  assert parallel.resolve(("batch", "length", "embed"), R) == P(("data", "fsdp", "expert"), "context", None)
  assert parallel.resolve(("expert", "embed", "mlp"), R) == P("expert", "fsdp", "tensor")
  assert parallel.resolve(("embed", "heads", "head_dim"), R) == P(("fsdp", "expert"), "tensor", None)
  sizes = dict(data=1, fsdp=2, expert=4, tensor=4)
  dropped = []
  # 6 heads over tensor 4: not divisible -> replicated; embed 12 over fsdp x expert = 8 -> fsdp only
  assert parallel.resolve(("embed", "heads"), R, sizes, (12, 6), dropped) == P("fsdp", None)
  assert len(dropped) == 2
  # size-1 mesh axes are left out: one layout (one compiled program) whatever the rules name
  ones = dict(data=1, fsdp=1, expert=2, context=1, tensor=1)
  assert parallel.resolve(("embed", "heads"), R, ones, (12, 6)) == P("expert", None)
  assert parallel.resolve(("vocab", "embed"), R, dict(ones, expert=1), (512, 128)) == P(None, None)
  # config override: prepended rules win
  R2 = parallel.rules({"mesh": {"rules": (("vocab", None), ("embed", "fsdp"))}})
  assert parallel.resolve(("vocab", "embed"), R2) == P(None, "fsdp")


def test_rules_and_mesh_errors():
  from stepflash_jax import parallel

  with pytest.raises(ValueError, match="mesh.rules"):
    parallel.rules({"mesh": {"rules": (("vocab", "model"),)}})
  with pytest.raises(ValueError, match="mesh"):
    parallel.mesh_shape(dict(data=2, fsdp=1, expert=4, tensor=1), 1)
  with pytest.raises(ValueError, match="mesh.fsdp"):
    parallel.mesh_shape(dict(data=-1, fsdp=-1, expert=1, tensor=1), 1)
  assert parallel.mesh_shape(dict(data=-1, fsdp=1, expert=1, tensor=1), 1)["data"] == 1
  from stepflash_jax.config import parse_expert_parallel as parse

  assert parse("ragged:1.5") == ("ragged", 1.5)
  with pytest.raises(ValueError, match="expert_parallel"):
    parse("alltoall")


def test_run_config_mesh_checks():
  from configs import sft as sft_config
  from stepflash_jax.train.validate import validate_run_config

  c = sft_config.get_config()
  c.mesh.expert = 3
  with pytest.raises(ValueError, match="mesh.expert"):
    validate_run_config(c, num_devices=3)  # 3 does not divide the 8 experts
  c.mesh.expert = 1
  c.mesh.rules = (("vocab", "model"),)
  with pytest.raises(ValueError, match="mesh.rules"):
    validate_run_config(c, num_devices=1)


def test_config_switch_validated(tiny_cfg):
  from stepflash_jax.config import model_args, validate

  c = tiny_cfg.copy_and_resolve_references()
  assert model_args(c).expert_parallel == "none"
  c.expert_parallel = "sometimes"
  with pytest.raises(ValueError, match="expert_parallel"):
    validate(c)
