"""stepflash_jax.caches: where rebuildable things live, and the persistent XLA cache switch."""

import jax

from stepflash_jax import caches


def test_cache_dir_follows_env(monkeypatch, tmp_path):
  monkeypatch.setenv("STEPFLASH_CACHE", str(tmp_path))
  assert caches.cache_dir("xla") == str(tmp_path / "xla")
  monkeypatch.delenv("STEPFLASH_CACHE")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert caches.cache_dir("tokenizer") == str(tmp_path / "home" / ".cache" / "stepflash_jax" / "tokenizer")


def test_enable_compile_cache_keeps_a_configured_cache(monkeypatch, tmp_path):
  old = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert caches.enable_compile_cache() == str(tmp_path / "mine")  # JAX_COMPILATION_CACHE_DIR wins
    assert caches.enable_compile_cache(str(tmp_path / "x")) == str(tmp_path / "x")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "x") and (tmp_path / "x").is_dir()
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("STEPFLASH_CACHE", str(tmp_path / "c"))
    assert caches.enable_compile_cache() == str(tmp_path / "c" / "xla")
  finally:
    jax.config.update("jax_compilation_cache_dir", old)


MOVED_CACHE_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from stepflash_jax import caches
caches.enable_compile_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""


def test_a_copied_compile_cache_still_hits(tmp_path):
  """A program cached at one path loads from a copy of the cache elsewhere: no new entry is written (a miss
  compiles and writes one)."""
  import shutil
  import subprocess
  import sys

  run = lambda path: subprocess.run([sys.executable, "-c", MOVED_CACHE_SCRIPT, str(path)], check=True, timeout=120)
  run(tmp_path / "a")
  entries = sorted(p.name for p in (tmp_path / "a").iterdir())
  assert entries  # the program was cached
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  run(tmp_path / "b")
  assert sorted(p.name for p in (tmp_path / "b").iterdir()) == entries


def test_share_adds_whole_entries_the_target_lacks(tmp_path):
  """caches.share links (or copies) src's cache entries missing in dst, keeps dst's own, skips other files."""
  src, dst = tmp_path / "src", tmp_path / "dst"
  src.mkdir(), dst.mkdir()
  for name, text in [("jit_a-1-cache", "a"), ("jit_b-2-cache", "b"), (".jit_c-3-cache.9.tmp", "partial")]:
    (src / name).write_text(text)
  (dst / "jit_b-2-cache").write_text("own")
  assert caches.share(str(src), str(dst)) == 1
  assert sorted(p.name for p in dst.iterdir()) == ["jit_a-1-cache", "jit_b-2-cache"]
  assert (dst / "jit_a-1-cache").read_text() == "a" and (dst / "jit_b-2-cache").read_text() == "own"
  assert caches.share(str(src), str(dst)) == 0


SHARE_WHEN_WRITTEN_SCRIPT = """
import json, os, sys, threading
import jax, jax.numpy as jnp
from jax import monitoring
from stepflash_jax import caches
src, dst = sys.argv[1], sys.argv[2]
caches.enable_compile_cache(src)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
caches.share_when_written(src, dst)
ls = lambda: json.dumps(sorted(n for n in os.listdir(dst) if not n.startswith(".")))
open(os.path.join(src, "jit_x-0-cache"), "w").write("x")
monitoring.record_event_duration_secs(caches.COMPILED_EVENT, 0.1)  # no entry written yet: nothing shared
print("BEFORE", ls())
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()  # MOVED_CACHE_SCRIPT's program
print("COMPILED", ls())
started, release = threading.Event(), threading.Event()
def writer():  # a thread that has begun writing an entry
  monitoring.record_event(caches.WRITE_EVENT)
  open(os.path.join(src, "jit_w-1-cache"), "w").write("part")
  started.set()
  release.wait()
  monitoring.record_event_duration_secs(caches.COMPILED_EVENT, 0.1)
t = threading.Thread(target=writer)
t.start()
started.wait()
monitoring.record_event(caches.WRITE_EVENT)  # this thread writes an entry and its compilation ends ...
monitoring.record_event_duration_secs(caches.COMPILED_EVENT, 0.1)
print("WRITING", ls())  # ... while the other thread still writes: nothing shared
release.set()
t.join()
print("DONE", ls())
"""


def test_share_when_written_hands_over_each_whole_entry(tmp_path):
  """caches.share_when_written: a compilation's entry is in dst when the call returns (and loads there: a process
  on dst compiles nothing new), nothing is shared before JAX's write event was seen or while any thread is still
  writing an entry, and everything once none is."""
  import json
  import subprocess
  import sys

  src, dst = tmp_path / "src", tmp_path / "dst"
  dst.mkdir()
  out = subprocess.run(
    [sys.executable, "-c", SHARE_WHEN_WRITTEN_SCRIPT, str(src), str(dst)],
    check=True,
    capture_output=True,
    text=True,
    timeout=120,
  ).stdout
  seen = {k: json.loads(v) for k, v in (line.split(" ", 1) for line in out.splitlines() if line[:1].isupper())}
  assert seen["BEFORE"] == []
  compiled = [n for n in seen["COMPILED"] if n != "jit_x-0-cache"]
  assert any(n.startswith("jit__lambda-") for n in compiled) and "jit_x-0-cache" in seen["COMPILED"]
  assert seen["WRITING"] == seen["COMPILED"]
  assert seen["DONE"] == sorted(seen["COMPILED"] + ["jit_w-1-cache"])
  assert all((dst / n).read_bytes() == (src / n).read_bytes() for n in compiled)
  for stand_in in ("jit_x-0-cache", "jit_w-1-cache"):  # not loadable entries
    (dst / stand_in).unlink()
  subprocess.run([sys.executable, "-c", MOVED_CACHE_SCRIPT, str(dst)], check=True, timeout=120)
  assert sorted(p.name for p in dst.iterdir()) == compiled  # it loaded: no entry written
