"""Multi-turn rollouts: the engine generates a turn until EOS or the tool-call end, the environment executes the
calls, the tool message joins the context and generation continues (docs/agents.md §3).

    gen = multi_turn(engine, variables, tok, prompts, examples, key, step_fn=env.step, executor=ex, max_turns=3,
                     max_response=96, call_end_id=tok.piece_to_id("</tool_call>"))

`engine` is a RolloutEngine with max_prompt_len = P + max_response (a later turn's context is the prompt and the
trajectory so far), max_new_tokens = one turn's budget and stop_ids = (call_end_id,). Each turn re-prefills the
whole context, so the engine's log-probs are those of a single pass over the final sequence (the training pass
reproduces them, tests/test_multi_turn.py). Rows leave the batch when they finish; the active rows are padded up
to the next of B, B/2, B/4, ... rows, not below MIN_ROWS, so at most log2(B / MIN_ROWS) + 1 batch shapes are
compiled.

Output (R = max_response), the engine's format plus what the trainer needs for tool outputs:
  response [B, R] int32      model tokens and tool-message tokens, pad after the end
  response_mask [B, R] f32   1 on the model's own tokens (loss, MIS ratios, values, routing statistics), 0 on
                             tool-message tokens and padding
  response_valid [B, R] f32  1 on every token of the trajectory (the training pass attends to tool outputs too)
  logp [B, R] f32            the engine's log-probs of the model's tokens, 0 elsewhere
  truncated [B] bool         the trajectory hit max_response; lengths [B] int32 (all tokens)
  turns, calls, parse_errors, tool_errors, timeouts [B] int32: per trajectory
step_fn({"example": ..., "text": the turn's text}) -> {"message": str, "calls", "parse_errors", "tool_errors",
"timeouts": int}: executes the turn's tool calls (a module-level function: executors may pickle it).
"""

from __future__ import annotations

import jax
import numpy as np

from stepflash_jax.agents import envs, executor
from stepflash_jax.agents.tools import CALL_CLOSE
from stepflash_jax.data import pad_prompts
from stepflash_jax.data.tokenizer import TOOL
from stepflash_jax.sampling import RolloutEngine

STATS = ("calls", "parse_errors", "tool_errors", "timeouts")


# the smallest batch a later turn runs with: a few decode rows cost less than compiling one more shape (~15 s each
# for the tiny model on 2 CPU cores)
MIN_ROWS = 8


def _bucket(n: int, B: int) -> int:
  """The smallest of B, ceil(B/2), ceil(B/4), ..., not below MIN_ROWS (or B), that holds n rows."""
  size = B
  while size > MIN_ROWS and -(-size // 2) >= max(n, MIN_ROWS):
    size = -(-size // 2)
  return size


class _Trajectories:
  """Per-row token lists of a batch of trajectories being built."""

  def __init__(self, B: int):
    self.tokens = [[] for _ in range(B)]
    self.own = [[] for _ in range(B)]  # 1 = the model's token
    self.logp = [[] for _ in range(B)]
    self.truncated = np.zeros(B, bool)
    self.stats = {k: np.zeros(B, np.int32) for k in ("turns",) + STATS}

  def add(self, b, tokens, own: bool, logp=None):
    self.tokens[b] += list(tokens)
    self.own[b] += [float(own)] * len(tokens)
    self.logp[b] += list(logp) if logp is not None else [0.0] * len(tokens)

  def arrays(self, R: int, pad_id: int) -> dict:
    B = len(self.tokens)
    out = {
      "response": np.full((B, R), pad_id, np.int32),
      "response_mask": np.zeros((B, R), np.float32),
      "response_valid": np.zeros((B, R), np.float32),
      "logp": np.zeros((B, R), np.float32),
    }
    for b in range(B):
      n = len(self.tokens[b])
      out["response"][b, :n] = self.tokens[b]
      out["response_mask"][b, :n] = self.own[b]
      out["response_valid"][b, :n] = 1.0
      out["logp"][b, :n] = self.logp[b]
    out["lengths"] = out["response_valid"].sum(1).astype(np.int32)
    return {**out, "truncated": self.truncated.copy(), **{k: v.copy() for k, v in self.stats.items()}}


def multi_turn(
  engine, variables, tok, prompts, examples, key, *, step_fn, executor, max_turns, max_response, call_end_id
):
  """Multi-turn trajectories for prompt token lists `prompts` (unpadded); see the module docstring."""
  B, width = len(prompts), engine.max_prompt_len
  if width < max(len(p) for p in prompts) + max_response:
    raise ValueError(f"engine.max_prompt_len={width} must hold the longest prompt + max_response={max_response}")
  traj, active = _Trajectories(B), list(range(B))
  conf, conf_layers = [], []
  for turn in range(max_turns):
    if not active:
      break
    rows = active + [active[0]] * (_bucket(len(active), B) - len(active))  # padding rows: outputs dropped
    ctx = pad_prompts([list(prompts[b]) + traj.tokens[b] for b in rows], width, pad_id=engine.pad_id)
    out = jax.device_get(engine.generate(variables, ctx["tokens"], ctx["lengths"], jax.random.fold_in(key, turn)))
    conf.append(float(out["routing_confidence"]))
    conf_layers.append({k: float(v) for k, v in out["routing_confidence_layers"].items()})
    calling = []
    for j, b in enumerate(active):
      n = int(out["lengths"][j])
      room = max_response - len(traj.tokens[b])
      gen = out["response"][j, : min(n, room)]
      traj.add(b, gen, True, out["logp"][j, : len(gen)])
      traj.stats["turns"][b] += 1
      if n > room:
        traj.truncated[b] = True
      elif len(gen) and gen[-1] == call_end_id and turn + 1 < max_turns:
        calling.append(b)
      else:  # EOS, the turn's budget without a stop token (truncated), or a call in the last allowed turn
        traj.truncated[b] = bool(out["truncated"][j])
    results = executor.map(
      step_fn, [{"example": examples[b], "text": tok.decode(_last_turn(traj, b))} for b in calling]
    )
    active = []
    for b, r in zip(calling, results):
      r = r if isinstance(r, dict) else {"message": f"environment failure: {getattr(r, 'error', r)}", "tool_errors": 1}
      for k in STATS:
        traj.stats[k][b] += int(r.get(k, 0))
      message = tok.encode(TOOL + r["message"]) + [tok.assistant_id]
      if len(traj.tokens[b]) + len(message) >= max_response:
        traj.truncated[b] = True  # no room for the result and an answer
        continue
      traj.add(b, message, False)
      active.append(b)
  gen = traj.arrays(max_response, engine.pad_id)
  gen["routing_confidence"] = np.float32(np.mean(conf))
  gen["routing_confidence_layers"] = {k: np.float32(np.mean([c[k] for c in conf_layers])) for k in conf_layers[0]}
  return gen


def _last_turn(traj, b) -> list:
  """The tokens of row b's latest model turn (the trailing run of own tokens)."""
  own, n = traj.own[b], len(traj.own[b])
  start = n
  while start > 0 and own[start - 1]:
    start -= 1
  return traj.tokens[b][start:]


def call_end_id(tok) -> int:
  """The id of the tool-call end (one piece in a tokenizer trained with the toolmul family's symbols)."""
  ids = tok.encode(CALL_CLOSE)
  if len(ids) != 1:
    raise ValueError(
      f"the tokenizer has no single piece for {CALL_CLOSE!r} (got {ids}): config field 'data.tokenizer_families' "
      "must include a tool-use family (e.g. toolmul)"
    )
  return ids[0]


class Agent:
  """Multi-turn sampling for a run config with an `agent` section (env, max_turns, turn_tokens, executor,
  workers): an engine that stops turns at the tool-call end, the environment's step function and an executor.

  max_response: the trajectory budget (rl.max_new_tokens or eval.max_new_tokens); the engine keyword arguments
  (dtype, temperature, top_p, logit_noise, quantize) as for RolloutEngine."""

  def __init__(self, config, tok, max_response: int, **engine_kw):
    a = config.agent
    self.tok, self.max_turns, self.max_response = tok, int(a.max_turns), int(max_response)
    self.call_end = call_end_id(tok)
    self.engine = RolloutEngine(
      config.model,
      max_prompt_len=config.data.max_prompt_len + self.max_response,
      max_new_tokens=min(int(a.turn_tokens), self.max_response),
      eos_id=tok.eos_id,
      pad_id=tok.pad_id,
      stop_ids=(self.call_end,),
      **engine_kw,
    )
    self.step_fn = envs.get(a.env)
    kw = {"max_workers": int(a.workers)} if a.executor == "local" else {}
    self.executor = executor.make(a.executor, **kw)

  def sample(self, variables, prompts, examples, key) -> dict:
    """prompts: a prompt batch (left-padded "tokens" [B, P], "lengths" [B]) -> multi_turn's output."""
    tokens, lens = np.asarray(prompts["tokens"]), np.asarray(prompts["lengths"])
    rows = [tokens[b, tokens.shape[1] - lens[b] :].tolist() for b in range(len(lens))]
    return multi_turn(
      self.engine,
      variables,
      self.tok,
      rows,
      examples,
      key,
      step_fn=self.step_fn,
      executor=self.executor,
      max_turns=self.max_turns,
      max_response=self.max_response,
      call_end_id=self.call_end,
    )

  def close(self):
    self.executor.close()


def tool_metrics(gen) -> dict:
  """Per-generation tool-use statistics of multi_turn's output: turns and tool calls per trajectory, the share of
  attempted calls that did not parse, and tool errors / timeouts per executed call."""
  calls, parse = gen["calls"].sum(), gen["parse_errors"].sum()
  return {
    "turns": float(gen["turns"].mean()),
    "tool_calls": float(gen["calls"].mean()),
    "parse_error_rate": float(parse / max(calls + parse, 1)),
    "tool_error_rate": float(gen["tool_errors"].sum() / max(calls, 1)),
    "tool_timeout_rate": float(gen["timeouts"].sum() / max(calls, 1)),
  }
