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
