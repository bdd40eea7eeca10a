"""Countdown demonstrated as a search (stepflash_jax/data/tasks/countdown_search.py): SFT, then MIS-PO RL.

  python experiments/run.py --config=configs/countdown_search.py         # runs/countdown_search: 13 min 48 s
  python experiments/run.py --config=configs/countdown_search.py:small   # smoke run of both stages
  python experiments/run.py --config=configs/countdown_search.py --config.data.mixture=countdown:3 \
      --workdir=runs/countdown_onetry                                     # countdown's demonstrations: 11 min 22 s
The two runs train on the same problems in the same order, hold out the same 1344 problems and share the main job's
tokenizer: only the demonstrations differ (one true chain; or 0-3 checked misses, then that chain). Measured
2026-12-05 (Intel Xeon with AMX, 2 cores, each alone, fresh cache): search 22.1 CPU-minutes, held-out 0.531 after
SFT -> 0.552 after RL; one try 18.1 CPU-minutes, 0.380 -> 0.420. README, "Countdown as a search"."""

from configs import mispo
from configs import sft as sft_config


def get_config(arg: str = ""):
  small = "small" in sft_config.options(arg)
  c = mispo.get_config(arg)
  c.data.mixture = "countdown_search:3"  # RL prompts and held-out problems too (rl.mixture ""): countdown's
  # 600: in the exploratory runs (README) 300 steps left the search demonstrations at 0.45 greedy accuracy, 600 at 0.57
  c.train.steps = 60 if small else 600
  c.train.eval_every = c.train.steps
  # the longest demonstration (3 misses) is ~90 tokens at difficulty 3; the one-try format needs <= 25
  c.eval.max_new_tokens = c.rl.max_new_tokens = 96
  c.rl.steps = 4 if small else 12  # a third of the main job's generations, all of them on countdown
  c.rl.oversample = 1  # every sampled prompt, as README's countdown figures were measured
  return c
