"""Agentic RL: SFT on tool-use demonstrations, then MIS-PO with multi-turn rollouts that call a calculator tool
(docs/agents.md; the task: stepflash_jax/agents/toolmul.py).

  python experiments/run.py --config=configs/agent.py          # 6.0 min on 2 cores (2026-12-02), runs/agent
  python experiments/run.py --config=configs/agent.py:small    # 5.9 min smoke run (compilation dominates)
The tiny model cannot multiply 3-4 digit numbers; with the `multiply` tool it has to write a well-formed call with
the right digits and copy the result out. The SFT demonstrations come from a weak teacher that skips the tool on
3-digit problems 70% of the time and answers an estimate (docs/agents.md §4), so the SFT policy does so too; RL
with the checker's reward has to teach it to call the tool. Measured 2026-12-02 (Intel Xeon @ 2.00GHz, 2 cores),
held-out greedy multi-turn accuracy (192 problems), SFT 80 steps -> 14 generations of MIS-PO: seed 0 0.495 -> 1.000
(3-digit problems 0.00 -> 1.00; tool calls per trajectory 0.72 -> 0.87 at temperature 1); seed 1 0.479 -> 0.990;
seed 2 0.464 -> 0.984 (+51 to +52 points; 5 min 51 s to 5 min 59 s wall each).
"""

import ml_collections

from configs import mispo
from configs import sft as sft_config


def get_config(arg: str = ""):
  small = "small" in sft_config.options(arg)
  c = mispo.get_config(arg)
  # a*b with 3-4 digit factors, demonstrated by the weak teacher (agents/toolmul.py): on 3-digit problems it answers
  # an estimate instead of calling the tool 70% of the time, so greedy SFT does too and RL has that half to fix
  c.data.mixture = "toolmul/weak:3-4:1"
  c.data.tokenizer_families = ("arithmetic", "countdown", "toolmul")  # + the tool-call template's pieces
  c.data.max_prompt_len = 24  # "Use multiply: 4942*7143" is 17 tokens
  c.data.seq_len = 256  # ~5 demonstrations per packed row
  c.train.steps = 40 if small else 80
  c.train.eval_every = c.train.steps

  c.agent = a = ml_collections.ConfigDict()
  a.env = "calculator"  # agents/envs.py: "calculator" (multiply) | "python" (sandboxed code)
  # model turns per trajectory: the call and the answer, and room for one more call. One field: rl.max_turns (issue
  # 15's name) and agent.max_turns (the multi-turn engine's, also used by the greedy eval) are the same reference
  c.rl.max_turns = 3
  a.max_turns = c.rl.get_ref("max_turns")
  a.turn_tokens = 40  # one call with an 8-digit operand is ~31 tokens
  a.executor = "local"  # "local" threads | "ray"
  a.workers = 4

  c.eval.num_examples = 32 if small else 192
  c.eval.batch_size = 32 if small else 96
  c.eval.max_new_tokens = 96  # the trajectory budget, tool messages included (one call: ~45 tokens)
  r = c.rl
  r.steps = 4 if small else 14  # 3-digit tool use is learnt between generations 7 and 14 (README)
  r.prompts_per_step = 8 if small else 12  # 96 trajectories: divisible by 4 actor and 12 critic mini-batches
  r.samples_per_prompt = 6 if small else 8  # report: 128 tool-use prompts x 8 responses
  r.max_new_tokens = 96
  r.oversample = 1  # every sampled prompt (multi-turn rollouts are the costly part; README's figures)
  # one decision token per trajectory (call or estimate) carries the signal: 3e-5 moved it by 4 points in 16
  # generations, 2e-4 learnt it by generation 10 and then drifted (KL 0.1, 3-digit accuracy 0.74 -> 0.57)
  r.actor_lr = 1e-4
  r.eval_every = 4 if small else 7
  return c
