"""Agentic RL: SFT on tool-use demonstrations, then MIS-PO with multi-turn rollouts that call a calculator tool
(docs/agents.md; the task: stepflash_jax/agents/toolmul.py).

  python experiments/run.py --config=configs/agent.py          # ~15 min on 2 cores (2026-12-02), runs/agent
  python experiments/run.py --config=configs/agent.py:small    # ~6 minute smoke run of every stage
The tiny model cannot multiply 3-4 digit numbers; with the `multiply` tool it has to write well-formed calls with
the right digits (one call for a*b, two for a*b*c, the second on the first's result) and copy the last result out.
Measured 2026-12-02 (Intel Xeon @ 2.00GHz, 2 cores), held-out greedy multi-turn accuracy (192 problems): SFT 150
steps 0.943; SFT 100 steps 0.464 (a*b 0.96, a*b*c 0.00: the second call's factor is not yet copied from the
prompt) -> 0.474 after 24 generations of MIS-PO (actor LR 3e-5). RL cannot improve a problem type on which the SFT
policy never succeeds; the SFT accuracy jumps from ~0.5 to ~0.85 between steps 90 and 100 of a 150-step run.
Not yet the +10-point job issue 15 asks for (see the README).
"""

import ml_collections

from configs import mispo
from configs import sft as sft_config


def get_config(arg: str = ""):
  small = "small" in sft_config.options(arg)
  c = mispo.get_config(arg)
  # one call (a*b) and two calls (a*b*c), 3-4 digit factors: trajectories of ~45 / ~90 tokens
  c.data.mixture = "toolmul:3-4:1,toolmul/3:3-4:1"
  c.data.tokenizer_families = ("arithmetic", "countdown", "toolmul")  # + the tool-call template's pieces
  c.data.max_prompt_len = 24  # "Use multiply: 4942*7143*8661" is 22 tokens
  c.data.seq_len = 256  # two demonstrations per packed row
  c.train.steps = 40 if small else 100  # 100: a*b solved, a*b*c not yet (docstring)
  c.train.eval_every = c.train.steps

  c.agent = a = ml_collections.ConfigDict()
  a.env = "calculator"  # agents/envs.py: "calculator" (multiply) | "python" (sandboxed code)
  a.max_turns = 3  # two calls and the answer
  a.turn_tokens = 40  # one call with an 8-digit operand is ~31 tokens
  a.executor = "local"  # "local" threads | "ray"
  a.workers = 4

  c.eval.num_examples = 32 if small else 192
  c.eval.batch_size = 32 if small else 96
  c.eval.max_new_tokens = 128  # the trajectory budget, tool messages included
  r = c.rl
  r.steps = 4 if small else 24
  r.prompts_per_step = 8 if small else 12  # 96 trajectories: divisible by 4 actor and 12 critic mini-batches
  r.samples_per_prompt = 6 if small else 8  # report: 128 tool-use prompts x 8 responses
  r.max_new_tokens = 128
  r.eval_every = 4 if small else 10
  return c
