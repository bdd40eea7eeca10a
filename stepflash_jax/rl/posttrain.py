"""The post-training pipeline (report §5, docs/rl.md §12) as one resumable job (config.job = "pipeline"):

  pretrain -> SFT -> RL of one expert per domain -> self-distillation (each expert re-rolls its domain's SFT
  prompts, rejection sampling: rl/distill.py) -> student SFT on the distilled data, from the pre-training
  checkpoint -> RL of the student on all domains (per-domain batch mix: pipeline.domains.<name>.weight)

A tool-use domain (pipeline.domains.<name>.agent) rolls out, evaluates and distills multi-turn trajectories with the
pipeline.agent environment; pipeline.domains.<name>.overrides sets its rl / eval / distill fields (domain_config).
A domain whose overrides.rl.reward is a learned one ("genrm" | "bt": the preference domain) trains its reward
models on pairs of SFT samples once, in <workdir>/reward_model (rl/reward_training.py, when its expert starts), and
the student's RL gives that domain's task families the same reward (rl.family_rewards, rewards.ByFamily).

The domains' chains (expert RL, its row, its share of the distillation) run side by side in one process per group
of pipeline.chains (the first group in this process; parallel.side_by_side), each group's domains in order; their
rows enter the table in the domains' order, so the table is the same however they are grouped.

Each stage runs in its own directory (<workdir>/<stage>, or pipeline.dirs.<stage> to reuse an existing run) with its
checkpoints, metrics and plots, then adds a row to the summary table: per domain, the held-out greedy accuracy or,
for pipeline.domains.<name>.metric = "greedy_gold", the mean hidden gold score (eval.num_examples test problems of
each domain's mixture). Rows live in <workdir>/pipeline.json (written atomically after each stage); a rerun skips
stages that have their row and resumes the first unfinished one from its own checkpoints, so a kill -9 anywhere
followed by the same command ends with the same table.
"""

from __future__ import annotations

import copy
import functools
import json
import os

import jax
import ml_collections

from stepflash_jax import caches, hf, host
from stepflash_jax import config as config_lib
from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.checks import is_int
from stepflash_jax.data import load_tokenizer_dir, tasks
from stepflash_jax.data.pipeline import example_dataset
from stepflash_jax.files import atomic_write
from stepflash_jax.rl import distill, reward_training, trainer, warmup
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


def _positive_ints(section, where: str, names) -> None:
  for f in names:
    if not (is_int(section[f]) and section[f] > 0):
      raise ValueError(f"config field '{where}.{f}': must be an int > 0, got {section[f]!r}")


def _check_distill(d, where: str) -> None:
  _positive_ints(d, where, ("prompts", "samples", "keep"))
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
  groups = all(isinstance(g, (tuple, list)) and all(isinstance(d, str) for d in g) for g in p.chains)
  if p.chains and not (groups and sorted(d for g in p.chains for d in g) == sorted(p.domains)):
    raise ValueError(
      f"config field 'pipeline.chains': groups of domain names with every domain once ({list(p.domains)}), "
      f"got {p.chains!r}"
    )
  learned = {i for i, g in enumerate(p.chains) for d in g if domain_config(config, d).rl.reward != config.rl.reward}
  if len(learned) > 1:  # they would train the shared reward models at the same time, in one directory
    raise ValueError("config field 'pipeline.chains': the domains with a learned reward must be in one group")
  _positive_ints(p, "pipeline", ("expert_steps", "student_sft_steps", "student_rl_steps"))
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


class Rows:
  """Rows of the summary table: per domain, the held-out metric of (variables, tokenizer) on eval.num_examples
  test problems of its mixture. Engines are made (and compiled) once: a multi-turn Agent per tool domain, one
  engine per eval length; leaving `with Rows(base) as rows:` stops the Agents' tool executors."""

  def __init__(self, base):
    self.domains = base.pipeline.domains
    self.evals = {d: domain_config(base, d) for d in self.domains}
    self.sets = {d: evaluate.heldout_examples(c) for d, c in self.evals.items()}
    self.engines = {}

  def __call__(self, variables, tok) -> dict:
    row = {}
    for d, c in self.evals.items():
      agent = self.domains[d].agent
      key = d if agent else c.eval.max_new_tokens
      if key not in self.engines:
        self.engines[key] = evaluate.eval_agent(c, tok) if agent else evaluate.eval_engine(c, tok, 0.0)
      row[d] = evaluate.accuracy(c, variables, tok, self.sets[d], self.engines[key])[self.domains[d].metric]
    return row

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    for e in self.engines.values():
      if hasattr(e, "close"):
        e.close()


def _on_mesh(config):
  return parallel.use_mesh(parallel.make_mesh(config.mesh), parallel.rules(config))


def _row_text(stage: str, row: dict) -> str:
  return f"pipeline: {stage}: " + ", ".join(f"{d} {a:.3f}" for d, a in row.items())


def run(config, workdir: str, log=print) -> dict:
  """Every stage (module docstring) -> the table rows {stage: {domain: accuracy}}."""
  p, domains = config.pipeline, config.pipeline.domains
  table = Table(workdir, domains)
  dirs = {s: p.dirs.get(s) or os.path.join(workdir, s) for s in STAGE_DIRS + tuple(f"expert_{d}" for d in domains)}
  sections = dict(train=dict(init_from=dirs["pretrain"]))
  if "reward_model" in config:  # every stage with a learned reward shares the models trained there
    sections["reward_model"] = dict(workdir=dirs["reward_model"])
  base = stage_config(config, mixture=combined_mixture(domains), **sections)
  # on the stages' mesh, as their trainers run: the evals and the stages' engines share compiled programs
  with _on_mesh(base), Rows(base) as rows:
    _stages(base, table, dirs, workdir, rows, log)
  log(table.markdown())
  return table.rows


def _stages(base, table, dirs, workdir, rows, log):
  """The stages without a row in the table, in order (module docstring); the domains' chains (expert, its row, its
  distillation share) side by side in pipeline.chains processes."""
  p, domains = base.pipeline, base.pipeline.domains

  def record(stage, variables, tok):
    table.add(stage, rows(variables, tok))
    log(_row_text(stage, table.rows[stage]))

  student, groups = _student(base), [tuple(g) for g in p.chains] or [tuple(domains)]
  if "sft" not in table.rows:
    with warmup.ahead(_ahead_stages(base, groups, dirs, table)):
      sft_out = sft.train(base, dirs["sft"], log=log, reuse="pipeline.dirs.sft" if p.dirs.get("sft") else None)

  def sft_row():  # evaluated beside the spawned chains' first stages
    if "sft" not in table.rows:
      record("sft", sft_out["variables"], sft_out["tokenizer"])

  data_path = os.path.join(dirs["distill"], "distilled.jsonl")
  experts = [f"expert_{d}" for d in domains]
  if not os.path.exists(data_path) or any(e not in table.rows for e in experts):
    tag = (lambda g: "[" + "+".join(g) + "] ") if len(groups) > 1 else (lambda g: "")
    done, cache = set(table.rows), jax.config.jax_compilation_cache_dir

    def here():
      sft_row()
      _chain(base, groups[0], dirs, workdir, done, rows, functools.partial(_tagged, log, tag(groups[0])))

    parallel.side_by_side(
      [(here, ())] + [(_spawned_chain, (base, g, dirs, workdir, done, cache, tag(g))) for g in groups[1:]]
    )
    for e in experts:  # in the domains' order, whichever chain finished first
      if e not in table.rows:
        table.add(e, json.load(open(_row_path(workdir, e))))
    if not os.path.exists(data_path):
      _gather(domains, dirs["distill"], data_path, log)
  sft_row()
  if "student_sft" not in table.rows:
    out = sft.train(student, dirs["student_sft"], log=log, examples=distill.read_examples(data_path))
    record("student_sft", out["variables"], out["tokenizer"])
  if "student_rl" not in table.rows:
    rl = dict(sft_workdir=dirs["student_sft"], steps=p.student_rl_steps, eval_every=p.student_rl_steps)
    trainer.run(student_rl_config(student, **rl), dirs["student_rl"], log=log)
    record("student_rl", *_exported(base, dirs["student_rl"]))


def _student(base):
  """The student's stages evaluate the combined mixture once, at their end, on one eval batch: their table rows
  are the per-domain evaluations (eval.num_examples problems of each domain)."""
  n = base.pipeline.student_sft_steps
  return stage_config(
    base, train=dict(steps=n, eval_every=n), eval=dict(num_examples=min(base.eval.num_examples, base.eval.batch_size))
  )


def _ahead_stages(base, groups, dirs, table):
  """With pipeline.compile_ahead: the RL programs of the experts without a row, for warmup.ahead beside
  pre-training and SFT, each chain of `groups` its first expert first."""
  order = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
  todo = [d for d in order if f"expert_{d}" not in table.rows] if base.pipeline.compile_ahead else []
  return [(f"expert_{d}", warmup.compile_rl, expert_config(base, d, dirs["sft"])) for d in todo]


def _tagged(log, tag: str, text: str) -> None:
  log("\n".join(tag + line for line in text.split("\n")))


def _row_path(workdir: str, stage: str) -> str:
  return os.path.join(workdir, "rows", f"{stage}.json")


def _chain(base, names, dirs, workdir, done, rows, log):
  """Each domain of `names` in turn: its expert's RL from the SFT run, its row (<workdir>/rows/expert_<d>.json;
  the caller adds it to the table) and its share of the distillation; a rerun keeps what exists. `done`: the
  stages the table already has."""
  order, data_path = list(base.pipeline.domains), os.path.join(dirs["distill"], "distilled.jsonl")
  for d in names:
    name, row_path = f"expert_{d}", _row_path(workdir, f"expert_{d}")
    need_row = name not in done and not os.path.exists(row_path)
    need_part = not os.path.exists(data_path) and not os.path.exists(os.path.join(dirs["distill"], f"{d}.jsonl"))
    if need_row:
      trainer.run(expert_config(base, d, dirs["sft"]), dirs[name], log=log)
    if need_row or need_part:
      variables, tok = _exported(base, dirs[name])
    if need_row:
      row = rows(variables, tok)
      atomic_write(row_path, json.dumps(row))
      log(_row_text(name, row))
    if need_part:
      _distill_domain(base, d, order.index(d), variables, tok, dirs["distill"], log)


def _spawned_chain(base, names, dirs, workdir, done, cache, tag):
  """_chain in a process of its own (parallel.side_by_side): the caller's compilation cache (programs compiled
  by either process load in the other), the stages' mesh, its log lines on stdout after `tag`."""
  host.keep_freed_memory()
  if cache:
    caches.enable_compile_cache(cache)
  log = functools.partial(_tagged, functools.partial(print, flush=True), tag)
  with _on_mesh(base), Rows(base) as rows:
    _chain(base, names, dirs, workdir, done, rows, log)


def _exported(config, run_dir):
  """(variables, tokenizer) of a finished RL run's export (<run_dir>/hf), the variables placed on the mesh as a
  trainer places them (the same placement compiles to the same program)."""
  keep = {k: config.model[k] for k in config_lib.IMPL_KEYS + ("param_dtype",)}
  variables = hf.load_hf_checkpoint(os.path.join(run_dir, "hf"), **keep)[1]
  mesh, rules = parallel.make_mesh(config.mesh), parallel.rules(config)
  variables = state_lib.place_state(variables, model_lib.as_args(config.model), mesh, rules)
  return variables, load_tokenizer_dir(os.path.join(run_dir, "hf"))


def _distill_domain(base, d, i, variables, tok, out_dir, log):
  """Domain d's expert (variables, tok) re-rolls distill.prompts SFT prompts of its domain (its overrides applied;
  sampling seed: pipeline seed + the domain's index i) -> <out_dir>/<d>.jsonl and <d>.counts.json."""
  dc = domain_config(base, d)
  ds = example_dataset(mixture=dc.data.mixture, split="train", seed=base.seed)
  prompts = [ds[k] for k in range(dc.distill.prompts)]
  kept, n = distill.distill_domain(dc, variables, tok, prompts, domain=d, expert=f"expert_{d}", seed=base.seed + i)
  if not kept:
    raise ValueError(
      f"distillation of {d!r} kept no response ({n}): train the expert longer or relax config field 'distill.filters'"
    )
  atomic_write(os.path.join(out_dir, f"{d}.counts.json"), json.dumps(n, indent=1))
  distill.write_examples(os.path.join(out_dir, f"{d}.jsonl"), kept)
  log(f"pipeline: distill {d}: " + ", ".join(f"{k} {v}" for k, v in n.items()))


def _gather(domains, out_dir, data_path, log):
  """Every domain's share, in the domains' order -> data_path, and their counts -> <out_dir>/counts.json."""
  records = [r for d in domains for r in distill.read_examples(os.path.join(out_dir, f"{d}.jsonl"))]
  counts = {d: json.load(open(os.path.join(out_dir, f"{d}.counts.json"))) for d in domains}
  atomic_write(os.path.join(out_dir, "counts.json"), json.dumps(counts, indent=1))
  distill.write_examples(data_path, records)
  log(f"pipeline: distilled {len(records)} examples -> {data_path}")
