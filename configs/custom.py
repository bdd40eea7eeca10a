"""Your checkpoint, your data: SFT + RL (MIS-PO) from a Hugging Face-layout Step3p5 checkpoint on a JSONL prompt file
(docs/data.md). The model, its weights and its tokenizer come from model.hf_dir; the prompts, references and
verifiers from data.jsonl (schema: stepflash_jax/data/jsonl.py); the result is exported to <workdir>/hf.

  python experiments/make_fixture.py --out runs/fixture          # a tiny checkpoint + 50 prompts, ~10 s
  python experiments/run.py --config=configs/custom.py --config.model.hf_dir=runs/fixture \\
      --config.data.jsonl=runs/fixture/prompts.jsonl --workdir=runs/custom   # 1 min 00 s on 2 cores (2026-12-02)
  python experiments/generate.py --checkpoint runs/custom/hf --prompt "Compute 12+30"
`:small` is the test-suite size (~25 s). A released-size checkpoint needs a mesh (config field mesh) and the
report's batch sizes; set train.steps=0 to start RL straight from the checkpoint (no SFT stage).
"""

from configs import mispo
from configs import sft as sft_config


def get_config(arg: str = ""):
  small = "small" in sft_config.options(arg)
  c = mispo.get_config(arg)
  c.data.jsonl = ""  # required: one JSON record per line (prompt, reference, verifier, response for SFT)
  c.data.max_prompt_len = 32  # chat-rendered prompts of the fixture are ~20 tokens; longer records are reported
  c.data.seq_len = 128
  c.data.batch_size = 8
  c.optim.lr = 1e-3  # a few hundred steps from a random fixture; use ~1e-5 for a pretrained checkpoint
  c.train.steps = 20 if small else 150
  c.train.eval_every = c.train.steps
  c.train.checkpoint_every = 10 if small else 50
  c.eval.num_examples = 64  # the test records of the file (at most this many)
  c.eval.batch_size = 16
  c.eval.max_new_tokens = 48
  c.rl.steps = 2 if small else 8
  c.rl.prompts_per_step = 4 if small else 8
  c.rl.samples_per_prompt = 6  # 24 / 48 responses per generation: 4 actor and 12 critic mini-batches divide it
  c.rl.max_new_tokens = 48
  c.rl.eval_every = c.rl.steps
  c.rl.checkpoint_every = 1 if small else 4
  c.rl.log_every = 1
  return c
