"""Context parallelism (parallel/context.py, docs/sharding.md §5) on 8 fake CPU devices against one device.

The checks run in one subprocess (tests/context_worker.py) so the rest of the suite keeps its single device."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5  # relative to the largest entry; float32 sums in a different order differ by ~1e-7


@pytest.fixture(scope="module")
def report():
  r = subprocess.run(
    [sys.executable, os.path.join(ROOT, "tests", "context_worker.py")], capture_output=True, text=True, timeout=1200
  )
  assert r.returncode == 0, r.stderr[-4000:]
  line = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")][-1]
  return json.loads(line[len("REPORT ") :])


def test_attention_op_matches_one_device(report):
  """Halo (windows 5 and 12 = two hops over shards of 8), ring and all-gather, packed or not, xla and pallas."""
  op = report["op"]
  assert len(op) == 16
  for name, d in op.items():
    assert d["y"] < TOL and d["grad"] < TOL, (name, d)


@pytest.mark.parametrize("mode", ["xla/ring", "pallas/ring", "xla/all_gather"])
def test_model_forward_backward_matches_one_device(report, mode):
  """data 2 x context 2 x tensor 2: logits and parameter gradients (MTP heads included), packed and unpacked."""
  m = report["model"][mode]
  for name in ("unpacked", "packed") if mode.endswith("ring") else ():  # all_gather: the op test has its values
    assert m[name]["logits"] < TOL and m[name]["grad"] < TOL, (name, m[name])
  assert m["swa_gathers"] == 0  # the SWA layers' q / k / v are never gathered ...
  assert m["swa_permutes"] > 0  # ... they exchange a halo
  assert (m["attn_gathers"] > 0) == (mode == "xla/all_gather")  # the ring gathers nothing either


def test_halo_bytes_scale_with_the_window_not_the_length(report):
  """Context 4: the SWA layers' collective-permute bytes per step are the same at T = 32 and 64 and double when
  W - 1 doubles (window 5 -> 9): the halo is W - 1 keys, values and segment ids."""
  h = report["halo"]
  assert h["T32/W5"]["bytes"] == h["T64/W5"]["bytes"] > 0
  assert all(x["swa_gathers"] == 0 for x in h.values())
  assert h["T32/W9"]["bytes"] == 2 * h["T32/W5"]["bytes"]
  assert h["T64/W5"]["full_bytes"] == 2 * h["T32/W5"]["full_bytes"]  # the ring's blocks grow with T


def test_exchange_estimate_is_what_the_compiled_step_sends(report):
  """parallel.context.exchange_bytes (what plan_pod.py prints for the real model) = the HLO's collective bytes."""
  for name, h in report["halo"].items():
    assert h["bytes"] + h["full_bytes"] == h["estimate"]["step"], name
