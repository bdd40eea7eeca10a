"""The post-training pipeline (rl/posttrain.py, rl/distill.py, configs/pipeline.py): rejection sampling against
hand-computed counts, the combined mixture, config errors, and the whole job - kill -9 in the middle of a stage and
the same command again give the uninterrupted run's table and distilled data, also when earlier stages are reused
from another run and the domains' chains run in two processes instead of one after the other."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import process_worker
import pytest

from stepflash_jax.config import load_config_file
from stepflash_jax.data import tasks
from stepflash_jax.data.tokenizer import ASSISTANT, TOOL, load_tokenizer
from stepflash_jax.rl import distill, posttrain
from stepflash_jax.train.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
  return tasks.generate("arithmetic", 3, 2, variant="+")


def test_select_counts_each_rejection_once():
  ex = _example()
  right, final = ex["answer"], ex["answer"].rsplit("</think>", 1)[1]
  wrong = right.replace(final, str(int(final) + 1))
  long_right = "<think>" + "x" * 5 + right[len("<think>") :]
  mixed = right.replace("</think>", "</think>\u0416")  # a Cyrillic letter: two scripts
  texts = [[right, wrong, right, long_right, mixed, right]]
  lengths = np.array([[10, 9, 10, 16, 11, 10]])
  truncated = np.array([[False, False, False, False, False, True]])  # the last one was cut off
  kept, counts = distill.select([ex], texts, lengths, truncated, ("correct", "mixed_script", "length"), 1.5, keep=2)
  # wrong, truncated and mixed (its final answer gained a letter: wrong too, and "correct" comes first) -> correct;
  # long_right is right but 16 > 1.5 x 10 tokens -> length; the second plain right -> duplicate
  assert counts == {
    "sampled": 6,
    "correct": 3,
    "mixed_script": 0,
    "length": 1,
    "duplicate": 1,
    "over_keep": 0,
    "kept": 1,
  }
  assert kept == [(0, right, 10)]
  kept, counts = distill.select([ex], texts, lengths, truncated, ("mixed_script",), 1.5, keep=2)
  assert counts["mixed_script"] == 1 and counts["duplicate"] == 2 and counts["over_keep"] == 1
  assert [t for _, t, _ in kept] == [right, wrong]
  assert sum(v for k, v in counts.items() if k != "sampled") == counts["sampled"]


def test_combined_mixture_scales_each_domain_to_its_weight():
  c = load_config_file(os.path.join(ROOT, "configs", "pipeline.py"))
  c.pipeline.domains.countdown.weight = 3.0
  mix = tasks.parse_mixture(posttrain.combined_mixture(c.pipeline.domains))
  by_family = {}
  for comp in mix:
    by_family[comp.family] = by_family.get(comp.family, 0.0) + comp.weight
  want = {"arithmetic": 1.0, "countdown": 3.0}
  want.update(toolmul=c.pipeline.domains.tool.weight, pref=c.pipeline.domains.preference.weight)
  assert by_family == pytest.approx(want)
  assert [m.variant for m in mix if m.family == "arithmetic"] == ["+", "+", "-", "*"]


def test_stage_configs_of_a_tool_domain():
  c = load_config_file(os.path.join(ROOT, "configs", "pipeline.py"))
  tool = posttrain.domain_config(c, "tool", rl=dict(steps=3))
  assert tool.data.mixture == c.pipeline.domains.tool.mixture and dict(tool.agent) == dict(c.pipeline.agent)
  assert (tool.rl.actor_lr, tool.rl.max_new_tokens, tool.eval.max_new_tokens, tool.rl.steps) == (1e-4, 96, 96, 3)
  arith = posttrain.domain_config(c, "arithmetic")
  assert "agent" not in arith and arith.rl.to_dict() == c.rl.to_dict()
  student = posttrain.student_rl_config(c, steps=5)  # multi-turn, the largest budget, the config's own LR
  assert "agent" in student and (student.rl.max_new_tokens, student.eval.max_new_tokens) == (96, 96)
  assert (student.rl.steps, student.rl.actor_lr) == (5, 3e-5)
  assert "agent" not in c and c.rl.max_new_tokens == 48  # copies: the pipeline config is unchanged
  # the student's RL rewards the preference domain's family with its judge, the others with the config's reward
  assert (dict(student.rl.family_rewards), student.rl.reward, dict(c.rl.family_rewards)) == (
    {"pref": "genrm"},
    "rule",
    {},
  )
  with c.pipeline.domains.tool.unlocked():
    c.pipeline.domains.tool.overrides.distill = dict(samples=2)
    c.pipeline.domains.tool.overrides.rl.steps = 7
  posttrain.check_config(c)
  assert (posttrain.domain_config(c, "tool").distill.samples, c.distill.samples) == (2, 4)
  # an expert runs its domain's overrides.rl.steps generations, or pipeline.expert_steps without one
  tool, arith = posttrain.expert_config(c, "tool", "s"), posttrain.expert_config(c, "arithmetic", "s")
  assert (tool.rl.steps, tool.rl.sft_workdir, tool.rl.actor_lr) == (7, "s", 1e-4)
  assert (arith.rl.steps, arith.rl.sft_workdir) == (c.pipeline.expert_steps, "s")


def test_distilled_tool_transcript_is_the_sft_answer_format(tmp_path):
  """A tool-use trajectory as the rollout builds it (model turns, then encode("<|tool|>R") + <|assistant|>),
  decoded as distillation writes it, formats back into the same tokens with loss on the model's turns only."""
  tok = load_tokenizer(str(tmp_path), families=("arithmetic", "countdown", "toolmul"))
  ex = tasks.generate("toolmul", 5, 3, variant="3")  # two calls
  first, *turns = ex["answer"].split(TOOL)
  traj, own = tok.encode(first), [1.0] * len(tok.encode(first))
  for turn in turns:
    result, _, answer = turn.partition(ASSISTANT)
    message = tok.encode(TOOL + result) + [tok.assistant_id]
    traj, own = traj + message + tok.encode(answer), own + [0.0] * len(message) + [1.0] * len(tok.encode(answer))
  text = tok.decode(np.asarray(traj + [tok.eos_id, tok.pad_id]), stop_at_eos=True)
  assert text == ex["answer"] and tasks.check(ex, text)
  ids, mask = tok.format_example(ex["prompt"], text)
  n = len(tok.format_prompt(ex["prompt"]))
  assert ids[n:].tolist() == traj + [tok.eos_id] and mask[n:].tolist() == own + [1.0]


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("pipeline.expert_steps", 0, "pipeline.expert_steps"),
    ("pipeline.expert_steps", True, "pipeline.expert_steps"),  # a bool is not a count
    ("distill.filters", ("correct", "nope"), "distill.filters"),
    ("distill.length_budget", 0.5, "distill.length_budget"),
    ("pipeline.agent.turn_tokens", 0, r"pipeline\.agent\.turn_tokens.*in pipeline\.domains\.tool"),
    ("pipeline.domains.arithmetic.mixture", "countdown:99", "pipeline.domains.arithmetic.mixture"),
    ("pipeline.domains.tool.overrides.rl.actor_lrr", 1e-4, r"pipeline\.domains\.tool\.overrides\.rl.*actor_lrr"),
    ("pipeline.domains.tool.overrides.eval.max_new_tokens", 0, "eval.max_new_tokens.*in pipeline.domains.tool"),
    (
      "pipeline.domains.tool.overrides.distill",
      {"samples": 0},
      r"pipeline\.domains\.tool\.overrides\.distill\.samples",
    ),
    ("pipeline.domains.tool.overrides.data", {"seed": 1}, r"pipeline\.domains\.tool\.overrides.*'data'"),
    ("pipeline.domains.preference.metric", "bleu", r"pipeline\.domains\.preference\.metric"),
    ("pipeline.domains.preference.overrides.rl.reward", "nope", r"rl\.reward.*in pipeline\.domains\.preference"),
    ("reward_model.train", ("bt",), r"reward_model\.train.*genrm"),
    ("pipeline.chains", (("arithmetic", "tool"),), r"pipeline\.chains.*every domain once"),
    ("pipeline.chains", (("arithmetic", "tool", "preference"), 9), r"pipeline\.chains.*every domain once"),
  ],
)
def test_config_errors_name_the_field(field, value, message):
  c = load_config_file(os.path.join(ROOT, "configs", "pipeline.py"), "small")
  posttrain.check_config(c)
  *path, name = field.split(".")
  section = c
  for key in path:
    section = section[key]
  with section.unlocked():
    section[name] = value
  with pytest.raises(ValueError, match=message):
    posttrain.check_config(c)


def _cmd(workdir, *extra):
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", "run.py"),
    "--config=" + os.path.join(ROOT, "configs", "pipeline.py:small"),
    f"--workdir={workdir}",
    "--config.rl.checkpoint_every=1",  # a checkpoint after each generation: a kill lands inside an RL stage
    *extra,
  ]


def _children(pid: int) -> list[int]:
  """The live processes whose parent is `pid` (Linux: the 4th field of /proc/<p>/stat)."""
  kids = []
  for p in filter(str.isdigit, os.listdir("/proc")):
    try:
      if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid and process_worker.alive(int(p)):
        kids.append(int(p))
    except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
      pass
  return kids


def test_pipeline_resumes_after_kill_with_the_same_table(tmp_path):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  a, b = tmp_path / "a", tmp_path / "b"
  # a: one process for the chains, and the compile-ahead helper beside pre-training and SFT (b has none; whatever
  # it compiled, the tables are the same)
  cmd = _cmd(a, "--config.pipeline.chains=()", "--config.pipeline.compile_ahead=True")
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = json.load(open(a / "pipeline.json"))
  stages = ["sft", "expert_arithmetic", "expert_preference", "expert_tool", "student_sft", "student_rl"]
  assert list(rows) == stages
  assert all(set(r) == {"arithmetic", "preference", "tool"} for r in rows.values())
  assert all(0 <= r["preference"] <= 1.5 for r in rows.values())  # its column: the mean gold score
  # the preference expert trained the judge once, in the pipeline's reward_model stage
  judge = a / "reward_model"
  assert (judge / "preferences" / "train.jsonl").exists() and (judge / "reward_genrm").exists()
  counts = json.load(open(a / "distill" / "counts.json"))
  # each domain samples its own prompts x samples (the tool domain's distill overrides: 16 x 1)
  small = load_config_file(os.path.join(ROOT, "configs", "pipeline.py"), "small")
  sampled = {d: posttrain.domain_config(small, d).distill for d in counts}
  sampled = {d: x.prompts * x.samples for d, x in sampled.items()}
  assert {d: n["sampled"] for d, n in counts.items()} == sampled and sampled["tool"] == 16
  for c in counts.values():
    assert sum(v for k, v in c.items() if k != "sampled") == c["sampled"]
  data = distill.read_examples(str(a / "distill" / "distilled.jsonl"))
  assert len(data) == sum(c["kept"] for c in counts.values())
  assert {r["domain"] for r in data} == {"arithmetic", "preference", "tool"}
  assert all(r["expert"] == f"expert_{r['domain']}" for r in data)
  want = {("arithmetic", "arithmetic"), ("preference", "pref"), ("tool", "toolmul")}
  assert {(r["domain"], r["family"]) for r in data} == want

  # b reuses a's pre-training, SFT, judge and the experts of the job's own chain (pipeline.dirs: their rows are
  # evaluated again) and runs the domains' chains in two processes (the small config's pipeline.chains: the
  # preference expert in a spawned one); killed inside that expert's RL, the spawned process dies with the job, and
  # the same command finishes with a's table
  reused = ["pretrain", "reward_model", "sft", "expert_arithmetic", "expert_tool"]
  reuse = [f"--config.pipeline.dirs.{s}={a / s}" for s in reused]
  p = subprocess.Popen(_cmd(b, *reuse), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ck, deadline = b / "expert_preference" / "rl" / "checkpoints" / "1", time.time() + 1200
  while not ck.exists() and p.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  spawned = _children(p.pid)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert ck.exists() and "expert_preference" not in json.load(open(b / "pipeline.json")), "killed at the wrong point"
  assert spawned, "the preference chain ran in no process of its own"
  deadline = time.time() + 10
  while any(map(process_worker.alive, spawned)) and time.time() < deadline:
    time.sleep(0.05)
  assert not any(map(process_worker.alive, spawned)), "a chain's process outlived the kill -9 of the job"
  out = subprocess.run(_cmd(b, *reuse), env=env, capture_output=True, text=True, timeout=1800)
  assert out.returncode == 0, out.stderr[-3000:]
  assert not (b / "sft").exists() and not (b / "reward_model").exists()
  assert "[preference] rl: resumed from generation 1" in out.stdout
  assert json.load(open(b / "pipeline.json")) == rows
  assert open(b / "distill" / "distilled.jsonl").read() == open(a / "distill" / "distilled.jsonl").read()
  assert (b / "summary.md").read_text() == (a / "summary.md").read_text()
  # the small table is mostly zeros: the student's training curves must be the uninterrupted run's too (timings
  # aside: time/*, *_s)
  curve = lambda f: [{k: v for k, v in r.items() if k[:5] != "time/" and k[-2:] != "_s"} for r in read_jsonl(f)]
  for f in ("student_sft/metrics_sft.jsonl", "student_rl/rl/metrics_rl.jsonl"):
    assert curve(b / f) == curve(a / f), f
