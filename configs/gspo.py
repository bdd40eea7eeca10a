"""The main job with the GSPO objective instead of MIS-PO (same budget, data, seeds and critic).

python experiments/run.py --config=configs/gspo.py      # ~38 minutes on 2 CPU cores (as mispo.py), writes runs/gspo
"""

from configs import mispo


def get_config(arg: str = ""):
  c = mispo.get_config(arg)
  c.rl.objective = "gspo"
  return c
