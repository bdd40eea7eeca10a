"""The colab/ notebooks run top to bottom in SMALL mode (STEPFLASH_SMALL=1) without a cell error.

Each notebook is executed with nbclient in a kernel running this very interpreter (a kernelspec written to a temp
JUPYTER_PATH), cwd = the repo root, STEPFLASH_WORKDIR = one temp dir shared by the four notebooks (notebook 04 reuses
the lab run of notebook 02), and a per-cell timeout. Besides "no error", one cheap key output per notebook is checked.
They also must be stored without outputs (valid nbformat 4). Measured on 2 idle cores with cold caches: 01 40 s,
02 100 s, 03 20 s, 04 80 s (it runs the truncation variants; 100 s alone): ~4 min for this file.
"""

import json
import os
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLAB = os.path.join(ROOT, "colab")
NOTEBOOKS = ["01_quickstart.ipynb", "02_mismatch_lab.ipynb", "03_kernels.ipynb", "04_truncation_and_routing.ipynb"]
KERNEL = "stepflash-test"
CELL_TIMEOUT = 900


@pytest.fixture(scope="module")
def nb_env(tmp_path_factory):
  """A kernelspec for sys.executable on JUPYTER_PATH, SMALL mode, one shared work dir."""
  jp = tmp_path_factory.mktemp("jupyter")
  spec = jp / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(
    json.dumps(
      {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "stepflash_jax tests",
        "language": "python",
      }
    )
  )
  work = tmp_path_factory.mktemp("notebooks")
  mp = pytest.MonkeyPatch()
  mp.setenv("JUPYTER_PATH", str(jp))
  mp.setenv("STEPFLASH_SMALL", "1")
  mp.setenv("STEPFLASH_WORKDIR", str(work))
  mp.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  yield work
  mp.undo()


def _text(nb) -> str:
  out = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      if o.get("output_type") == "stream":
        out.append(o.get("text", ""))
      elif "data" in o:
        out.append(o["data"].get("text/plain", "") + o["data"].get("text/markdown", ""))
  return "\n".join(out)


def _images(nb) -> int:
  return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs(name):
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  nbformat.validate(nb)
  assert nb.nbformat == 4
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, name
  first = next(c for c in nb.cells if c.cell_type == "code").source
  assert "import stepflash_jax" in first and "!pip install -q git+" in first and "except ImportError" in first
  assert 'os.environ.get("STEPFLASH_SMALL", "1") == "1"' in first


EXPECT = {  # notebook -> (strings its outputs must contain, minimum number of images)
  "01_quickstart.ipynb": (["held-out accuracy", "routing confidence", "MIS-PO loss", "traj_keep_frac"], 0),
  "02_mismatch_lab.ipynb": (
    ["| variant", "mispo/int8/replay", "ppo/int8", "actor grad-norm std MIS-PO", "router replay off vs on"],
    4,  # curves of the one setting (int8) and of each objective (mispo, ppo), grad-norm / routing
  ),
  "03_kernels.ipynb": (["sliding_window_attention", "grouped_matmul", "interpret mode"], 1),
  "04_truncation_and_routing.ipynb": (["trunc-bootstrap", "trunc-zero", "Sigma_k", "measured_rate"], 3),
}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(nb_env, name):
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  client = nbclient.NotebookClient(
    nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT, allow_errors=False, resources={"metadata": {"path": ROOT}}
  )
  t0 = time.time()
  client.execute()  # raises CellExecutionError (with the traceback) on the first failing cell
  text = _text(nb)
  own = [line for line in text.splitlines() if "notebook time:" in line]
  print(f"{name}: {time.time() - t0:.0f}s ({own[-1].strip() if own else 'no timing line'})")
  strings, n_images = EXPECT[name]
  for s in strings:
    assert s in text, f"{name}: output lacks {s!r}"
  assert _images(nb) >= n_images, f"{name}: {_images(nb)} images, expected >= {n_images}"
  if name == "02_mismatch_lab.ipynb":
    assert os.path.exists(os.path.join(nb_env, "lab", "lab_table.md"))
    assert os.path.exists(os.path.join(nb_env, "lab", "lab_table.csv"))
