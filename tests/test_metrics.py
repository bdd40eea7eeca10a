"""MetricsWriter (JSONL + TB, resume truncation), Progress, StageClock, plot_metrics, summary_table."""

import io
import json
import math
import os
import re
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax.train import metrics as metrics_lib
from stepflash_jax.train.metrics import MetricsWriter, Progress, StageClock, plot_metrics, read_jsonl, summary_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_jsonl_written_flushed_and_readable(tmp_path):
  w = MetricsWriter(tmp_path, name="train")
  w.write(1, {"loss": jnp.float32(2.5), "lr": 1e-3, "tokens": np.int64(128), "ok": True})
  # flushed before close: another reader sees the line now
  with open(tmp_path / "metrics_train.jsonl") as f:
    assert json.loads(f.readline()) == {"step": 1, "loss": 2.5, "lr": 1e-3, "tokens": 128, "ok": 1}
  w.write(2, {"loss": np.array(2.0), "nan": float("nan")})
  w.close()
  recs = read_jsonl(tmp_path / "metrics_train.jsonl")
  assert [r["step"] for r in recs] == [1, 2]
  assert isinstance(recs[0]["tokens"], int) and math.isnan(recs[1]["nan"])
  with pytest.raises(ValueError, match="'vec'.*shape \\(3,\\)"):
    MetricsWriter(tmp_path, name="x", tensorboard=False).write(0, {"vec": np.zeros(3)})
  with pytest.raises(ValueError, match="'step'"):
    MetricsWriter(tmp_path, name="y", tensorboard=False).write(0, {"step": 1})


def test_tensorboard_event_files(tmp_path):
  with MetricsWriter(tmp_path, name="eval") as w:
    for s in range(3):
      w.write(s, {"acc": 0.1 * s})
  files = os.listdir(tmp_path / "tb" / "eval")
  ev = [f for f in files if f.startswith("events.out.tfevents")]
  assert ev and os.path.getsize(tmp_path / "tb" / "eval" / ev[0]) > 0
  scalars = _read_tb_scalars(tmp_path / "tb" / "eval" / ev[0])
  assert [st for st, _ in scalars["acc"]] == [0, 1, 2]
  np.testing.assert_allclose([v for _, v in scalars["acc"]], [0.0, 0.1, 0.2], rtol=1e-6)
  # resume at step 1: the new event file starts with a purge marker at step 2 (TB drops >= 2)
  with MetricsWriter(tmp_path, name="eval", resume_step=1) as w:
    w.write(2, {"acc": 0.5})
  (newest,) = set(os.listdir(tmp_path / "tb" / "eval")) - set(files)
  evs = _read_tb_events(tmp_path / "tb" / "eval" / newest)
  from tensorboardX.proto.event_pb2 import SessionLog

  assert any(e.session_log.status == SessionLog.START and e.step == 2 for e in evs)


def _read_tb_events(path):
  """Parse a TFRecord event file (u64 len, u32 crc, data, u32 crc) into Event protos."""
  from tensorboardX.proto.event_pb2 import Event

  out, data, i = [], open(path, "rb").read(), 0
  while i < len(data):
    (n,) = struct.unpack("<Q", data[i : i + 8])
    out.append(Event.FromString(data[i + 12 : i + 12 + n]))
    i += 12 + n + 4
  return out


def _read_tb_scalars(path):
  out = {}
  for ev in _read_tb_events(path):
    for v in ev.summary.value:
      out.setdefault(v.tag, []).append((ev.step, v.simple_value))
  return out


def test_resume_truncation_and_torn_line(tmp_path):
  w = MetricsWriter(tmp_path, tensorboard=False)
  for s in range(1, 11):
    w.write(s, {"loss": 10.0 - s})
  w.close()
  with open(tmp_path / "metrics_train.jsonl", "a") as f:  # crash mid-write: torn last line
    f.write('{"step": 11, "lo')
  assert [r["step"] for r in read_jsonl(tmp_path / "metrics_train.jsonl")] == list(range(1, 11))
  # resumed from the checkpoint at step 6: steps 7..10 will be redone -> dropped
  w = MetricsWriter(tmp_path, resume_step=6, tensorboard=False)
  w.write(7, {"loss": 3.5})
  w.close()
  recs = read_jsonl(tmp_path / "metrics_train.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6, 7]
  assert recs[-1]["loss"] == 3.5
  w = MetricsWriter(tmp_path, tensorboard=False)  # plain append, no truncation
  assert w.truncate_after(3) == 4
  w.write(4, {"loss": 0.0})
  w.close()
  assert [r["step"] for r in read_jsonl(tmp_path / "metrics_train.jsonl")] == [1, 2, 3, 4]


def test_progress_line_format():
  buf = io.StringIO()
  p = Progress(total_steps=100, every=10, desc="train", keys=["loss", "lr"], file=buf)
  assert p.update(5, {"loss": 1.0}) is None
  line = p.update(10, {"loss": 2.31456, "lr": 3e-4, "other": 7})
  assert buf.getvalue().strip() == line
  m = re.fullmatch(
    r"train  10/100 \( 10%\) \| ([0-9.e+]+) step/s \| ETA (\S+) \| "
    r"loss 2\.315 lr 3\.00e-04",
    line,
  )
  assert m, line
  rate = float(m.group(1))
  assert rate > 0 and m.group(2) != "?"
  assert p.update(100, {}).startswith("train 100/100 (100%)")  # last step always printed


def test_progress_stdout(capsys):
  Progress(total_steps=4, every=2).update(2, {"loss": jnp.float32(0.5)})
  out = capsys.readouterr().out
  assert "2/4" in out and "step/s" in out and "ETA" in out and "loss 0.5" in out


def test_plot_metrics_png(tmp_path):
  for run, scale in (("a", 1.0), ("b", 2.0)):
    with MetricsWriter(tmp_path / run, tensorboard=False) as w:
      for s in range(5):
        w.write(s, {"loss": scale / (s + 1), "kl": 0.01 * s})
  out = tmp_path / "plots" / "cmp.png"
  plotted = plot_metrics(
    {"a": tmp_path / "a" / "metrics_train.jsonl", "b": tmp_path / "b" / "metrics_train.jsonl"},
    ["loss", "kl", "missing"],
    out,
    title="runs",
  )
  assert plotted == ["loss", "kl"]
  data = out.read_bytes()
  assert data[:8] == PNG_MAGIC and len(data) > 1000
  recs = read_jsonl(tmp_path / "a" / "metrics_train.jsonl")
  assert plot_metrics(recs, ["loss"], tmp_path / "one.png") == ["loss"]
  assert (tmp_path / "one.png").read_bytes()[:8] == PNG_MAGIC
  assert plot_metrics(recs, ["nope"], tmp_path / "none.png") == []
  # a tuple of keys shares one panel (e.g. a proxy reward and the gold score), present if any of them is
  assert plot_metrics(recs, [("loss", "kl"), ("nope", "kl"), ("nope", "none")], tmp_path / "pair.png") == [
    ("loss", "kl"),
    ("nope", "kl"),
  ]
  assert (tmp_path / "none.png").read_bytes()[:8] == PNG_MAGIC


def test_summary_table():
  rows = [{"run": "base", "loss": 2.3145678, "steps": 100}, {"run": "mis|po", "loss": 1.5e-5}]
  t = summary_table(rows, ["run", "loss", "steps"])
  assert t.split("\n") == [
    "| run     | loss     | steps |",
    "|:--------|---------:|------:|",
    "| base    |    2.315 |   100 |",
    "| mis\\|po | 1.50e-05 |       |",
  ]
  with pytest.raises(ValueError, match="headers"):
    summary_table(rows, ["run"], headers=["a", "b"])


def test_stage_clock_charges_intervals_and_waits_for_outputs(monkeypatch):
  """Each stop charges the time since the previous stop to its stage (repeated names add up); stop(name, outputs)
  blocks on the outputs first (the fake clock advances only when block_until_ready has run)."""
  now = [10.0]
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: now[0])
  blocked = []
  monkeypatch.setattr("jax.block_until_ready", lambda x: (blocked.append(x), now.__setitem__(0, now[0] + 4.0))[0])
  clock = StageClock()
  now[0] += 1.5
  clock.stop("rollout")
  now[0] += 0.25
  clock.stop("actor", [jnp.ones(2)])
  now[0] += 2.0
  clock.stop("rollout")
  assert clock.seconds() == {"time/rollout": 3.5, "time/actor": 4.25}
  assert len(blocked) == 1
