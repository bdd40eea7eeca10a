"""The main job with the PPO objective instead of MIS-PO (same budget, data, seeds and critic).

python experiments/run.py --config=configs/ppo.py      # as long as mispo.py (its docstring), writes runs/ppo
"""

from configs import mispo


def get_config(arg: str = ""):
  c = mispo.get_config(arg)
  c.rl.objective = "ppo"
  return c
