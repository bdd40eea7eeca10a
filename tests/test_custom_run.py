"""Bring your own checkpoint and data (configs/custom.py): SFT + RL from the locally made HF fixture on its JSONL
prompts through experiments/run.py; bad records reported by line, kill -9 + rerun equal to an uninterrupted run, and
the exported checkpoint reloading with the trained actor's exact logits."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import stepflash_jax as sfj
from stepflash_jax.data import load_tokenizer_dir
from stepflash_jax.fixtures import make_fixture
from stepflash_jax.train.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_LINES = [
  '{"prompt": "Compute 1+1", "reference": "2"',
  '{"prompt": "Compute 1+1", "reference": "2", "verifier": "nope"}',
]


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
  d = make_fixture(str(tmp_path_factory.mktemp("fixture")), num_prompts=40)
  with open(os.path.join(d, "prompts.jsonl"), "a") as f:  # records 41 and 42 are bad
    f.write("\n".join(BAD_LINES) + "\n")
  return d


def _cmd(fixture_dir, workdir):
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", "run.py"),
    "--config=" + os.path.join(ROOT, "configs", "custom.py:small"),
    f"--workdir={workdir}",
    f"--config.model.hf_dir={fixture_dir}",
    f"--config.data.jsonl={os.path.join(fixture_dir, 'prompts.jsonl')}",
    "--config.train.steps=10",
    "--config.train.checkpoint_every=5",
    "--config.eval.num_examples=8",
    "--config.eval.batch_size=8",
  ]


def _rl_rows(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "rl", "metrics_rl.jsonl"))]


def test_custom_run_resumes_after_kill_and_exports(fixture_dir, tmp_path):
  """(Exact equality of a resumed RL run with an uninterrupted one: test_trainer.py; here the HF / JSONL path.)"""
  env, b = dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path / "b"
  p = subprocess.Popen(_cmd(fixture_dir, b), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ck, deadline = b / "rl" / "checkpoints" / "1", time.time() + 900
  while not ck.exists() and p.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert ck.exists(), "the run never wrote its first RL checkpoint"
  out = subprocess.run(_cmd(fixture_dir, b), env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "rl: resumed from generation 1" in out.stdout
  assert "prompts.jsonl: 40 valid records (train 32, test 8), 2 skipped" in out.stdout
  assert "prompts.jsonl:41: not valid JSON" in out.stdout and "prompts.jsonl:42: field 'verifier'" in out.stdout
  rows = [r for r in _rl_rows(b) if "reward" in r]
  assert [r["step"] for r in rows] == [1, 2]
  assert json.load(open(b / "summary.json"))["generations"] == 2

  # The export holds the final actor exactly: same logits as the RL checkpoint's parameters.
  cfg, v = sfj.load_hf_checkpoint(str(b / "hf"))
  state, _ = Checkpointer(str(b / "rl" / "checkpoints")).restore()
  actor = {"params": state["actor"]["params"], "router": state["actor"]["router"]}
  tok = load_tokenizer_dir(str(b / "hf"))
  ids = np.asarray([tok.format_prompt("Compute 12+30")], np.int32)
  np.testing.assert_array_equal(sfj.forward(cfg, v, ids), sfj.forward(cfg, actor, ids))
