"""Metrics: JSONL + TensorBoard writer, console progress, PNG plots, markdown summary tables.

Files under `workdir`:
    metrics_{name}.jsonl   one line per `write`: {"step": int, "<key>": number, ...}, flushed per line
    tb/{name}/events.*     TensorBoard scalars (tensorboardX)

Resume semantics: construct `MetricsWriter(workdir, name, resume_step=s)` with the step of the
restored checkpoint. Lines with step > s are dropped from the JSONL (that work was lost with the
crash and will be logged again), and the TensorBoard writer is opened with `purge_step=s + 1`, which
makes TensorBoard discard older events with step > s. Without `resume_step` the JSONL is appended to
as is. A torn last line (crash mid-write, no trailing newline) is cut off before appending.
NaN/inf are written as JSON `NaN`/`Infinity` (Python's json reads them back).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Iterable, Mapping, Sequence

import numpy as np

from stepflash_jax.checks import is_int, is_number


def _scalar(key: str, v):
  """int/bool -> int, other real scalars (numpy, 0-d jax/np arrays) -> float."""
  if isinstance(v, (bool, np.bool_)):
    return int(v)
  if isinstance(v, (int, np.integer)):
    return int(v)
  if isinstance(v, (float, np.floating)):
    return float(v)
  if hasattr(v, "__array__"):
    a = np.asarray(v)
    if a.ndim == 0 and a.dtype.kind in "biuf":
      return int(a) if a.dtype.kind in "biu" else float(a)
    raise ValueError(f"metric {key!r} must be a real scalar, got shape {a.shape} dtype {a.dtype}")
  raise ValueError(f"metric {key!r} must be a real scalar, got {type(v).__name__}")


def read_jsonl(path) -> list[dict]:
  """All records of a JSONL file; a torn (undecodable) final line is skipped."""
  with open(path, "r", encoding="utf-8") as f:
    lines = f.read().split("\n")
  out = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:  # last line without newline: torn by a crash
        break
      raise ValueError(f"{path}: line {i + 1} is not valid JSON: {line[:80]!r}")
  return out


class MetricsWriter:
  """Append scalars to workdir/metrics_{name}.jsonl and TensorBoard workdir/tb/{name}."""

  def __init__(self, workdir, name: str = "train", resume_step: int | None = None, tensorboard: bool = True):
    self.workdir = os.fspath(workdir)
    self.name = name
    self.path = os.path.join(self.workdir, f"metrics_{name}.jsonl")
    self.tb_dir = os.path.join(self.workdir, "tb", name)
    os.makedirs(self.workdir, exist_ok=True)
    self._repair_torn_tail()
    if resume_step is not None:
      self.truncate_after(resume_step)
    self._f = open(self.path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      # unique suffix: a writer reopened within the same second must not clobber the old file
      self._tb = SummaryWriter(
        self.tb_dir,
        flush_secs=5,
        filename_suffix=f".{time.time_ns()}",
        purge_step=None if resume_step is None else resume_step + 1,
      )

  def _repair_torn_tail(self):
    if not os.path.exists(self.path):
      return
    with open(self.path, "rb+") as f:
      data = f.read()
      if data and not data.endswith(b"\n"):
        f.truncate(data.rfind(b"\n") + 1)

  def truncate_after(self, step: int) -> int:
    """Drop JSONL records with step > `step` (atomic rewrite). Returns how many were dropped."""
    if not os.path.exists(self.path):
      return 0
    recs = read_jsonl(self.path)
    keep = [r for r in recs if r.get("step", -math.inf) <= step]
    if len(keep) == len(recs):
      return 0
    reopen = getattr(self, "_f", None) is not None and not self._f.closed
    if reopen:
      self._f.close()
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      for r in keep:
        f.write(json.dumps(r) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    if reopen:
      self._f = open(self.path, "a", encoding="utf-8")
    return len(recs) - len(keep)

  def write(self, step: int, scalars: Mapping[str, object]):
    """Append one record {"step": step, **scalars} (flushed) and the TB scalars."""
    if "step" in scalars:
      raise ValueError("scalars must not contain the key 'step' (pass it as `step`)")
    rec = {"step": int(step)}
    rec.update({str(k): _scalar(str(k), v) for k, v in scalars.items()})
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in rec.items():
        if k != "step":
          self._tb.add_scalar(k, v, global_step=rec["step"])
      self._tb.flush()

  def close(self):
    if not self._f.closed:
      self._f.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _fmt_num(v) -> str:
  if is_int(v):
    return str(int(v))
  v = float(v)
  if v != v or v in (math.inf, -math.inf):
    return str(v)
  if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
    return f"{v:.2e}"
  return f"{v:.4g}"


def _fmt_time(sec: float) -> str:
  if not math.isfinite(sec):
    return "?"
  sec = int(round(sec))
  h, rem = divmod(sec, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class StageClock:
  """Wall time of the stages of one iteration: `stop(name, outputs)` waits for `outputs` (jax arrays) and charges
  the time since the previous stop to `name`; `seconds()` -> {"time/<name>": s} (JSONL / TensorBoard)."""

  def __init__(self):
    self._t, self._times = time.perf_counter(), {}

  def stop(self, name: str, outputs=None):
    if outputs is not None:
      import jax

      jax.block_until_ready(outputs)
    now = time.perf_counter()
    self._times[name] = self._times.get(name, 0.0) + now - self._t
    self._t = now

  def seconds(self) -> dict:
    return {f"time/{k}": v for k, v in self._times.items()}


class Progress:
  """Console progress: every `every` steps (and at the last step) prints

      desc  120/1000 ( 12%) | 3.41 step/s | ETA 4m18s | loss 2.314 lr 3.00e-04

  rate = steps since the previous line / seconds since it (the first line: since construction).
  """

  def __init__(
    self,
    total_steps: int,
    every: int = 10,
    desc: str = "train",
    keys: Sequence[str] | None = None,
    start_step: int = 0,
    file=None,
  ):
    if every < 1:
      raise ValueError(f"every must be >= 1, got {every}")
    self.total, self.every, self.desc, self.keys = int(total_steps), int(every), desc, keys
    self.file = file
    self._last_step, self._last_t = int(start_step), time.perf_counter()

  def update(self, step: int, metrics: Mapping[str, object] | None = None) -> str | None:
    """Print (and return) a line when step % every == 0 or step == total; else None."""
    if step % self.every and step != self.total:
      return None
    now = time.perf_counter()
    dt, ds = now - self._last_t, step - self._last_step
    rate = ds / dt if dt > 0 and ds > 0 else float("nan")
    eta = (self.total - step) / rate if rate == rate and rate > 0 else float("inf")
    self._last_step, self._last_t = step, now
    width = len(str(self.total))
    pct = 100.0 * step / max(self.total, 1)
    parts = [f"{self.desc} {step:>{width}}/{self.total} ({pct:3.0f}%)", f"{rate:.3g} step/s", f"ETA {_fmt_time(eta)}"]
    if metrics:
      keys = self.keys if self.keys is not None else list(metrics)
      kv = [f"{k} {_fmt_num(_scalar(k, metrics[k]))}" for k in keys if k in metrics]
      if kv:
        parts.append(" ".join(kv))
    line = " | ".join(parts)
    print(line, file=self.file or sys.stdout, flush=True)
    return line


def _as_runs(runs) -> list[tuple[str | None, list[dict]]]:
  """Normalize plot input to [(label, records)]."""
  if isinstance(runs, (str, os.PathLike)):
    return [(os.path.basename(os.fspath(runs)), read_jsonl(runs))]
  if isinstance(runs, Mapping):
    return [(str(lbl), _as_runs(r)[0][1]) for lbl, r in runs.items()]
  runs = list(runs)
  if runs and all(isinstance(r, Mapping) for r in runs):  # one run given as records
    return [(None, runs)]
  out = []
  for i, r in enumerate(runs):
    if isinstance(r, (str, os.PathLike)):
      out.append((os.path.dirname(os.fspath(r)) or os.fspath(r), read_jsonl(r)))
    else:
      out.append((f"run{i}", list(r)))
  return out


def plot_metrics(runs, keys: Sequence[str], out_png, title: str | None = None, ncols: int = 3) -> list[str]:
  """One subplot per key (x = step), runs overlaid with labels; keys absent everywhere skipped. A tuple of keys
  shares one subplot (e.g. a proxy reward and the gold score).

  runs: a JSONL path, a list of records, a list of paths / record lists, or {label: path|records}.
  Uses matplotlib's Agg canvas directly (no pyplot, global backend untouched). Returns the keys
  plotted; if none is present the PNG only carries a "no data" note.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  runs = _as_runs(runs)
  group = lambda k: tuple(k) if isinstance(k, (tuple, list)) else (k,)
  present = [k for k in keys if any(s in r for s in group(k) for _, recs in runs for r in recs)]
  n = max(len(present), 1)
  nc = min(ncols, n)
  nr = math.ceil(n / nc)
  fig = Figure(figsize=(4.2 * nc, 3.0 * nr), dpi=100)
  FigureCanvasAgg(fig)
  if not present:
    fig.text(0.5, 0.5, f"no data for {list(keys)}", ha="center", va="center")
  for i, k in enumerate(present):
    ax = fig.add_subplot(nr, nc, i + 1)
    for label, recs in runs:
      for sub in group(k):
        pts = sorted((r["step"], r[sub]) for r in recs if sub in r and "step" in r and r[sub] is not None)
        if pts:
          xs, ys = zip(*pts)
          name = sub if label is None or len(runs) == 1 else f"{label} {sub}" if len(group(k)) > 1 else label
          ax.plot(xs, ys, label=name, lw=1.2, marker="." if len(xs) < 30 else None)
    ax.set_title(" / ".join(group(k)), fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(runs) > 1 or len(group(k)) > 1:
      ax.legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  out_png = os.fspath(out_png)
  if os.path.dirname(out_png):
    os.makedirs(os.path.dirname(out_png), exist_ok=True)
  fig.savefig(out_png, format="png")
  return present


def summary_table(
  rows: Iterable[Mapping[str, object]], columns: Sequence[str], headers: Sequence[str] | None = None
) -> str:
  """Markdown table, one row per dict; missing cells empty, numbers compact and right-aligned.

  | run | loss |
  |:----|-----:|
  | a   | 2.31 |
  """
  rows = list(rows)
  headers = list(headers) if headers is not None else list(columns)
  if len(headers) != len(columns):
    raise ValueError(f"headers has {len(headers)} entries, columns has {len(columns)}")

  def cell(v):
    if v is None:
      return ""
    if isinstance(v, (bool, np.bool_)):
      return str(bool(v))
    if is_number(v):
      return _fmt_num(v)
    return str(v).replace("|", "\\|").replace("\n", " ")

  def numeric(c):
    vals = [r[c] for r in rows if r.get(c) is not None]
    return bool(vals) and all(map(is_number, vals))

  body = [[cell(r.get(c)) for c in columns] for r in rows]
  widths = [max([len(h), 3] + [len(b[j]) for b in body]) for j, h in enumerate(headers)]
  right = [numeric(c) for c in columns]

  def line(cells, align=False):
    out = [(c.rjust(w) if (align and r) else c.ljust(w)) for c, w, r in zip(cells, widths, right)]
    return "| " + " | ".join(out) + " |"

  sep = "|" + "|".join((("-" * (w + 1) + ":") if r else (":" + "-" * (w + 1))) for w, r in zip(widths, right)) + "|"
  return "\n".join([line(headers), sep] + [line(b, align=True) for b in body])
