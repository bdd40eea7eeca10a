"""The main job with the GSPO objective instead of MIS-PO (same budget, data, seeds and critic).

python experiments/run.py --config=configs/gspo.py      # as long as mispo.py (its docstring), writes runs/gspo
"""

from configs import mispo


def get_config(arg: str = ""):
  c = mispo.get_config(arg)
  c.rl.objective = "gspo"
  return c
