"""The post-training pipeline (report §5, docs/rl.md §12) as one resumable job (config.job = "pipeline"):

  pretrain -> SFT -> RL of one expert per domain -> self-distillation (each expert re-rolls its domain's SFT
  prompts, rejection sampling: rl/distill.py) -> student SFT on the distilled data, from the pre-training
  checkpoint -> RL of the student on all domains (per-domain batch mix: pipeline.domains.<name>.weight)

A tool-use domain (pipeline.domains.<name>.agent) rolls out, evaluates and distills multi-turn trajectories with the
pipeline.agent environment; pipeline.domains.<name>.overrides sets its rl / eval / distill fields (domain_config).
A domain whose overrides.rl.reward is a learned one ("genrm" | "bt": the preference domain) trains its reward
models on pairs of SFT samples once, in <workdir>/reward_model (rl/reward_training.py, when its expert starts), and
the student's RL gives that domain's task families the same reward (rl.family_rewards, rewards.ByFamily).

Each stage runs in its own directory (<workdir>/<stage>, or pipeline.dirs.<stage> to reuse an existing run) with its
checkpoints, metrics and plots, then adds a row to the summary table: per domain, the held-out greedy accuracy or,
for pipeline.domains.<name>.metric = "greedy_gold", the mean hidden gold score (eval.num_examples test problems of
each domain's mixture). Rows live in <workdir>/pipeline.json (written atomically after each stage); a rerun skips
stages that have their row and resumes the first unfinished one from its own checkpoints, so a kill -9 anywhere
followed by the same command ends with the same table.
"""

from __future__ import annotations

import copy
import json
import os

import ml_collections

from stepflash_jax import config as config_lib
from stepflash_jax import hf
from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.data import load_tokenizer_dir, tasks
from stepflash_jax.data.pipeline import example_dataset
from stepflash_jax.files import atomic_write
from stepflash_jax.rl import distill, reward_training, trainer
from stepflash_jax.train import evaluate, sft
from stepflash_jax.train import state as state_lib
from stepflash_jax.train.metrics import summary_table
from stepflash_jax.train.validate import validate_run_config


def mixture_spec(components) -> str:
  """MixtureComponents -> the 'family[/variant]:lo-hi:weight,...' string (parse_mixture's inverse for ranges)."""
  parts = []
  for c in components:
    d = c.difficulties
    if d != tuple(range(d[0], d[-1] + 1)):
      raise ValueError(f"mixture component {c}: difficulties must be a contiguous range")
    parts.append(f"{c.family}{'/' + c.variant if c.variant else ''}:{d[0]}-{d[-1]}:{c.weight:g}")
  return ",".join(parts)


def combined_mixture(domains) -> str:
  """The domains' mixtures in one, each domain's weights scaled so that its total is pipeline.domains.<d>.weight."""
  comps = []
  for d in domains.values():
    mix = tasks.parse_mixture(d.mixture)
    total = sum(c.weight for c in mix)
    comps += [tasks.MixtureComponent(c.family, c.difficulties, d.weight * c.weight / total, c.variant) for c in mix]
  return mixture_spec(comps)


class Table:
  """The summary rows {stage: {domain: accuracy}} in <workdir>/pipeline.json (+ summary.md), saved atomically."""

  def __init__(self, workdir: str, domains):
    self.path, self.domains = os.path.join(workdir, "pipeline.json"), list(domains)
    self.rows = json.load(open(self.path)) if os.path.exists(self.path) else {}

  def add(self, stage: str, row: dict) -> None:
    self.rows[stage] = row
    atomic_write(self.path, json.dumps(self.rows, indent=1))
    atomic_write(os.path.join(os.path.dirname(self.path), "summary.md"), self.markdown() + "\n")

  def markdown(self) -> str:
    rows = [{"stage": s, **{d: r[d] for d in self.domains}} for s, r in self.rows.items()]
    return summary_table(rows, ["stage"] + self.domains)


def stage_config(config, mixture: str | None = None, **sections):
  """A copy of the pipeline config for one stage: data.mixture and fields of other sections replaced (a section
  the config lacks, e.g. `agent`, is added)."""
  c = copy.deepcopy(config)
  with c.unlocked():
    if mixture is not None:
      c.data.mixture = mixture
    for section, fields in sections.items():
      if section in c:
        c[section].update(fields)
      else:
        c[section] = ml_collections.ConfigDict(dict(fields))
  return c


OVERRIDES = ("rl", "eval", "distill")  # the sections a domain may override
METRICS = ("accuracy", "greedy_gold")  # a domain's summary-table column: exact match or mean gold score
STAGE_DIRS = ("pretrain", "sft", "reward_model", "distill", "student_sft", "student_rl")  # + expert_<domain>


def domain_config(config, name: str, **sections):
  """The config of one domain's expert, eval and distillation: its mixture, its section overrides
  (pipeline.domains.<name>.overrides) and, for a tool-use domain (agent=True), the `agent` section
  (pipeline.agent) that switches rollouts and evals to multi-turn (agents/rollout.py)."""
  dom = config.pipeline.domains[name]
  extra = {k: dict(v) for k, v in dom.overrides.items()}
  if dom.agent:
    extra["agent"] = dict(config.pipeline.agent)
  for section, fields in sections.items():
    extra[section] = {**extra.get(section, {}), **fields}
  return stage_config(config, dom.mixture, **extra)


def expert_config(config, name: str, sft_dir: str):
  """Domain `name`'s expert: RL from the SFT run in sft_dir for its overrides.rl.steps generations, else
  pipeline.expert_steps."""
  steps = config.pipeline.domains[name].overrides.get("rl", {}).get("steps", config.pipeline.expert_steps)
  return domain_config(config, name, rl=dict(sft_workdir=sft_dir, steps=steps))


def student_rl_config(config, **rl):
  """The student's RL on all domains: multi-turn rollouts when any domain uses tools (a prompt without a call
  ends after one turn), with the largest response budget (rl and eval) any domain asks for, and each domain's own
  reward (overrides.rl.reward) for its task families."""
  doms = config.pipeline.domains.values()
  budget = lambda s: max([config[s].max_new_tokens] + [d.overrides.get(s, {}).get("max_new_tokens", 0) for d in doms])
  own = {
    c.family: d.overrides.rl.reward
    for d in doms
    if d.overrides.get("rl", {}).get("reward", config.rl.reward) != config.rl.reward
    for c in tasks.parse_mixture(d.mixture)
  }
  rl = {**rl, "max_new_tokens": budget("rl"), "family_rewards": {**dict(config.rl.family_rewards), **own}}
  sections = {"rl": rl, "eval": {"max_new_tokens": budget("eval")}}
  if any(d.agent for d in doms):
    sections["agent"] = dict(config.pipeline.agent)
  return stage_config(config, **sections)


def _check_distill(d, where: str) -> None:
  for f in ("prompts", "samples", "keep"):
    if not (isinstance(d[f], int) and d[f] > 0):
      raise ValueError(f"config field '{where}.{f}': must be an int > 0, got {d[f]!r}")
  if not d.length_budget >= 1:
    raise ValueError(f"config field '{where}.length_budget': must be >= 1, got {d.length_budget}")
  distill.check_filters(d.filters)


def check_config(config) -> None:
  """The pipeline and distill sections (ValueError naming the field)."""
  p = config.pipeline
  if not p.domains:
    raise ValueError("config field 'pipeline.domains': at least one domain")
  for name, dom in p.domains.items():
    try:
      tasks.parse_mixture(dom.mixture)
    except ValueError as e:
      raise ValueError(f"config field 'pipeline.domains.{name}.mixture': {e}") from None
    if not dom.weight > 0:
      raise ValueError(f"config field 'pipeline.domains.{name}.weight': must be > 0, got {dom.weight}")
    if dom.metric not in METRICS:
      raise ValueError(f"config field 'pipeline.domains.{name}.metric': one of {METRICS}, got {dom.metric!r}")
    for section in dom.overrides:
      if section not in OVERRIDES or not isinstance(dom.overrides[section], ml_collections.ConfigDict):
        raise ValueError(
          f"config field 'pipeline.domains.{name}.overrides': sections {OVERRIDES} only (dicts), got {section!r}"
        )
      unknown = set(dom.overrides[section]) - set(config[section])
      if unknown:
        raise ValueError(f"config field 'pipeline.domains.{name}.overrides.{section}': unknown {sorted(unknown)}")
  for f in ("expert_steps", "student_sft_steps", "student_rl_steps"):
    if not (isinstance(p[f], int) and p[f] > 0):
      raise ValueError(f"config field 'pipeline.{f}': must be an int > 0, got {p[f]!r}")
  _check_distill(config.distill, "distill")
  stages = {f"pipeline.domains.{n}": domain_config(config, n) for n in p.domains}
  for n, c in stages.items():
    _check_distill(c.distill, f"{n}.overrides.distill")
  stages["the student's RL (pipeline.agent when a domain uses tools)"] = student_rl_config(config)
  for where, c in stages.items():  # the overrides and the agent section, checked as their stage will run
    try:
      validate_run_config(c)
      reward_training.check_config(c)
    except ValueError as e:
      raise ValueError(str(e).replace("field 'agent.", "field 'pipeline.agent.") + f" (in {where})") from None
  unknown = set(p.dirs) - set(STAGE_DIRS) - {f"expert_{n}" for n in p.domains}
  if unknown:
    raise ValueError(f"config field 'pipeline.dirs': unknown stage(s) {sorted(unknown)}")


def run(config, workdir: str, log=print) -> dict:
  """Every stage (module docstring) -> the table rows {stage: {domain: accuracy}}."""
  p, domains = config.pipeline, config.pipeline.domains
  table = Table(workdir, domains)
  stage_dir = lambda name: p.dirs.get(name) or os.path.join(workdir, name)
  sections = dict(train=dict(init_from=stage_dir("pretrain")))
  if "reward_model" in config:  # every stage with a learned reward shares the models trained there
    sections["reward_model"] = dict(workdir=stage_dir("reward_model"))
  base = stage_config(config, mixture=combined_mixture(domains), **sections)
  evals = {d: domain_config(base, d) for d in domains}
  eval_sets = {d: evaluate.heldout_examples(evals[d]) for d in domains}
  engines = {}  # made (and compiled) once: a multi-turn Agent per tool domain, one engine per eval length

  def record(stage, variables, tok):
    row = {}
    for d, c in evals.items():
      key = d if domains[d].agent else c.eval.max_new_tokens
      if key not in engines:
        engines[key] = evaluate.eval_agent(c, tok) if domains[d].agent else evaluate.eval_engine(c, tok, 0.0)
      row[d] = evaluate.accuracy(c, variables, tok, eval_sets[d], engines[key])[domains[d].metric]
    table.add(stage, row)
    log(f"pipeline: {stage}: " + ", ".join(f"{d} {a:.3f}" for d, a in row.items()))

  try:  # on the stages' mesh, as their trainers run: the evals and the stages' engines share compiled programs
    with parallel.use_mesh(parallel.make_mesh(base.mesh), parallel.rules(base)):
      _stages(base, table, stage_dir, record, log)
  finally:
    for e in engines.values():
      if hasattr(e, "close"):  # an Agent's tool executor
        e.close()
  log(table.markdown())
  return table.rows


def _stages(base, table, stage_dir, record, log):
  """The stages without a row in the table, in order (module docstring)."""
  p, domains = base.pipeline, base.pipeline.domains
  if "sft" not in table.rows:
    out = sft.train(base, stage_dir("sft"), log=log, reuse="pipeline.dirs.sft" if p.dirs.get("sft") else None)
    record("sft", out["variables"], out["tokenizer"])
  for d in domains:
    name = f"expert_{d}"
    if name not in table.rows:
      trainer.run(expert_config(base, d, stage_dir("sft")), stage_dir(name), log=log)
      record(name, *_exported(base, stage_dir(name)))
  data_path = os.path.join(stage_dir("distill"), "distilled.jsonl")
  if not os.path.exists(data_path):
    _distill(base, domains, stage_dir, data_path, log)
  # the student's stages evaluate (the combined mixture) once, at their end: the table rows are per domain
  student = stage_config(base, train=dict(steps=p.student_sft_steps, eval_every=p.student_sft_steps))
  if "student_sft" not in table.rows:
    out = sft.train(student, stage_dir("student_sft"), log=log, examples=distill.read_examples(data_path))
    record("student_sft", out["variables"], out["tokenizer"])
  if "student_rl" not in table.rows:
    rl = dict(sft_workdir=stage_dir("student_sft"), steps=p.student_rl_steps, eval_every=p.student_rl_steps)
    rl_cfg = student_rl_config(student, **rl)
    trainer.run(rl_cfg, stage_dir("student_rl"), log=log)
    record("student_rl", *_exported(base, stage_dir("student_rl")))


def _exported(config, run_dir):
  """(variables, tokenizer) of a finished RL run's export (<run_dir>/hf), the variables placed on the mesh as a
  trainer places them (the same placement compiles to the same program)."""
  keep = {k: config.model[k] for k in config_lib.IMPL_KEYS + ("param_dtype",)}
  variables = hf.load_hf_checkpoint(os.path.join(run_dir, "hf"), **keep)[1]
  mesh, rules = parallel.make_mesh(config.mesh), parallel.rules(config)
  variables = state_lib.place_state(variables, model_lib.as_args(config.model), mesh, rules)
  return variables, load_tokenizer_dir(os.path.join(run_dir, "hf"))


def _distill(base, domains, stage_dir, data_path, log):
  """Each expert re-rolls distill.prompts SFT prompts of its domain (its overrides applied) -> <dir>/<domain>.jsonl
  and <domain>.counts.json (a rerun keeps a finished domain's files), then all domains in data_path and counts.json."""
  out_dir, records, counts = os.path.dirname(data_path), [], {}
  for i, d in enumerate(domains):
    part, part_counts = os.path.join(out_dir, f"{d}.jsonl"), os.path.join(out_dir, f"{d}.counts.json")
    if not os.path.exists(part):
      variables, tok = _exported(base, stage_dir(f"expert_{d}"))
      dc = domain_config(base, d)
      ds = example_dataset(mixture=dc.data.mixture, split="train", seed=base.seed)
      prompts = [ds[k] for k in range(dc.distill.prompts)]
      kept, n = distill.distill_domain(dc, variables, tok, prompts, domain=d, expert=f"expert_{d}", seed=base.seed + i)
      if not kept:
        raise ValueError(
          f"distillation of {d!r} kept no response ({n}): train the expert longer or relax config field "
          "'distill.filters'"
        )
      atomic_write(part_counts, json.dumps(n, indent=1))
      distill.write_examples(part, kept)
    records += distill.read_examples(part)
    counts[d] = json.load(open(part_counts))
    log(f"pipeline: distill {d}: " + ", ".join(f"{k} {v}" for k, v in counts[d].items()))
  atomic_write(os.path.join(out_dir, "counts.json"), json.dumps(counts, indent=1))
  distill.write_examples(data_path, records)
