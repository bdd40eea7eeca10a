"""The package's layering: every import points down, no import cycle, no function-local import of our own modules.

Layers, bottom to top (a module may import its own package and the layers below it):
  kernels (pallas_kernels) < checks < ops < parallel, caches, host, files < config, data, optim < model < hf, sampling
  < agents, fixtures
  < train < rl
  < the package root (stepflash_jax/__init__.py re-exports the public API).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = [
  {"pallas_kernels"},
  {"stepflash_jax.checks"},
  {"stepflash_jax.ops"},
  {"stepflash_jax.parallel", "stepflash_jax.caches", "stepflash_jax.host", "stepflash_jax.files"},
  {"stepflash_jax.config", "stepflash_jax.data", "stepflash_jax.optim"},
  {"stepflash_jax.model"},
  {"stepflash_jax.hf", "stepflash_jax.sampling"},
  {"stepflash_jax.agents", "stepflash_jax.fixtures"},
  {"stepflash_jax.train"},
  {"stepflash_jax.rl"},
  {"stepflash_jax"},
]
LAYER = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}


def _modules() -> dict:
  """{dotted module name: path} of every module of the two packages."""
  out = {}
  for top in ("stepflash_jax", "pallas_kernels"):
    for path in (ROOT / top).rglob("*.py"):
      parts = path.relative_to(ROOT).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _package(module: str) -> str:
  """The layer unit of a module: pallas_kernels, stepflash_jax.<subpackage or module>, or stepflash_jax itself."""
  parts = module.split(".")
  return parts[0] if parts[0] == "pallas_kernels" or len(parts) == 1 else ".".join(parts[:2])


def _imports(module: str, path: pathlib.Path, modules: dict):
  """Yield (imported project module, is_function_local) for every import statement of the file."""
  tree = ast.parse(path.read_text())
  base = module if path.name == "__init__.py" else module.rpartition(".")[0]
  local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      pkg = node.module or ""
      if node.level:
        pkg = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + ([pkg] if pkg else []))
      names = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in modules else pkg for a in node.names]
    else:
      continue
    for name in names:
      while name not in modules and "." in name:
        name = name.rpartition(".")[0]
      if name in modules and name != module:
        yield name, id(node) in local


def _graph():
  modules = _modules()
  return {m: set(_imports(m, p, modules)) for m, p in modules.items()}


def test_every_import_points_down():
  graph = _graph()
  assert set(map(_package, graph)) <= set(LAYER), sorted(set(map(_package, graph)) - set(LAYER))
  bad = [
    f"{m} imports {d}"
    for m, deps in graph.items()
    for d, _ in deps
    if _package(d) != _package(m) and LAYER[_package(d)] >= LAYER[_package(m)]
  ]
  assert not bad, bad


def test_no_function_local_imports_of_our_modules():
  bad = [f"{m} imports {d} inside a function" for m, deps in _graph().items() for d, local in deps if local]
  assert not bad, bad


def test_no_import_cycle():
  edges = {m: {d for d, _ in deps} for m, deps in _graph().items()}
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for d in sorted(edges[m]):
      if state.get(d) == "open":
        raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
      if d not in state:
        visit(d, stack + [d])
    state[m] = "done"

  for m in sorted(edges):
    if m not in state:
      visit(m, [m])


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
  # The rules above are only as good as the parser: a fake tree with a cycle and an upward import must fail them.
  for rel, text in {
    "stepflash_jax/__init__.py": "",
    "stepflash_jax/ops/__init__.py": "from stepflash_jax.model import x\n",
    "stepflash_jax/model/__init__.py": "from . import core\n",
    "stepflash_jax/model/core.py": "def f():\n  from stepflash_jax.model import other\n",
    "stepflash_jax/model/other.py": "from stepflash_jax.model.core import f\n",
    "pallas_kernels/__init__.py": "",
  }.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(text)
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  graph = _graph()
  assert ("stepflash_jax.model", False) in graph["stepflash_jax.ops"]  # upward: ops -> model
  assert ("stepflash_jax.model.other", True) in graph["stepflash_jax.model.core"]  # function-local
  for test in (test_every_import_points_down, test_no_function_local_imports_of_our_modules, test_no_import_cycle):
    try:
      test()
    except AssertionError:
      continue
    raise AssertionError(f"{test.__name__} passed on a tree that breaks it")
