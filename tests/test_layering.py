"""The house in layers: every import inside `tpustrat/` (lazy and `TYPE_CHECKING` ones included) goes to
the same layer or below, and no set of modules imports itself in a cycle.

The intended layers are written once, in `LAYERS` below (lowest first). `docs/design.md` describes them.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tpustrat"

# Lowest first. A module belongs to the first entry that names it or a package above it.
LAYERS: list[tuple[str, ...]] = [
    # The version; JAX compatibility; names and validation shared with the launcher; host buffers.
    ("tpustrat._version", "tpustrat._src.jax_compat", "tpustrat._src.names", "tpustrat._src.validation",
     "tpustrat._src.host_memory", "tpustrat._src.watchdog", "tpustrat._src.termination_notice", "tpustrat._src.profiler",
     "tpustrat._src.compilation_cache", "tpustrat._src.step_hooks", "tpustrat._src.step_stats",
     "tpustrat._src.conv_layouts"),
    # Values (replicated, per replica, sharded) and the reduce op.
    ("tpustrat._src.values", "tpustrat._src.sharded_variable", "tpustrat._src.reduce_op"),
    # The context: thread-local state only.
    ("tpustrat._src.context",),
    # Collectives and reductions.
    ("tpustrat._src.gradient_semantics", "tpustrat._src.groups", "tpustrat._src.grouped_sums",
     "tpustrat._src.collectives", "tpustrat._src.all_reduce", "tpustrat._src.reduce", "tpustrat._src.losses",
     "tpustrat._src.replica_random"),
    # The engine (a mesh and a replica count), and the logical-core annotations it honours.
    ("tpustrat._src.logical", "tpustrat._src.logical_interpreter", "tpustrat._src.batch_rows",
     "tpustrat._src.block_statistics", "tpustrat._src.padding_reads", "tpustrat._src.numerics",
     "tpustrat._src.engine"),
    # Input, and the stacked-steps layout it shares with multistep.
    ("tpustrat._src.steps", "tpustrat._src.input"),
    # Multistep; cross-device ops; the cluster and its topology.
    ("tpustrat._src.multistep", "tpustrat._src.sharding", "tpustrat._src.zero", "tpustrat._src.accumulation",
     "tpustrat._src.mixed_precision", "tpustrat._src.keras_models", "tpustrat._src.keras_fit",
     "tpustrat._src.cross_device",
     "tpustrat._src.distributed", "tpustrat._src.cluster_environment", "tpustrat._src.cluster_spec",
     "tpustrat._src.cluster_resolver", "tpustrat._src.cluster_connection", "tpustrat._src.tpu_cluster_resolver",
     "tpustrat._src.slurm_cluster_resolver", "tpustrat._src.tfconfig_cluster_resolver",
     "tpustrat._src.connect_to_cluster", "tpustrat._src.topology"),
    # Strategies.
    ("tpustrat._src.strategy_extended", "tpustrat._src.strategy", "tpustrat._src.tpu_strategy",
     "tpustrat._src.mirrored_strategy"),
    # State beyond the loop: checkpoint, the preemption handler that saves through it, sharded embeddings.
    ("tpustrat._src.checkpoint", "tpustrat._src.preemption", "tpustrat._src.embedding", "tpustrat._src.summary",
     "tpustrat._src.keras_callbacks"),
    # The public surface.
    ("tpustrat._src", "tpustrat.ops", "tpustrat.checkpoint", "tpustrat.cluster_resolver", "tpustrat.embedding",
     "tpustrat.mixed_precision", "tpustrat.keras", "tpustrat.summary", "tpustrat.experimental", "tpustrat.launch",
     "tpustrat"),
]


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
  return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
  """Every tpustrat module `path` imports, wherever the import statement stands."""
  name = module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolve against this module's package
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:  # `import tpustrat._src.x.y` names its deepest module
        target = target.rpartition(".")[0]
      if target.startswith("tpustrat") and target != name:
        found.add(target)
  return found


def layer_of(name: str, layers: list[tuple[str, ...]]) -> int:
  for i, members in enumerate(layers):
    if any(name == m or name.startswith(m + ".") for m in members):
      return i
  raise KeyError(name)


def violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
  """Upward edges, modules missing from `layers`, and import cycles of `graph`, as messages."""
  found = []
  for name in sorted(graph):
    try:
      mine = layer_of(name, layers)
    except KeyError:
      found.append(f"{name} is in no layer of LAYERS")
      continue
    for dep in sorted(graph[name]):
      if dep in graph and layer_of(dep, layers) > mine and not name.startswith(dep + "."):
        found.append(f"upward edge: {name} (layer {mine}) imports {dep} (layer {layer_of(dep, layers)})")
  # Cycles: Tarjan's strongly connected components.
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in graph:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      # A package's __init__ importing its own submodules is not a cycle of the design.
      if len(component) > 1 and not all(c.startswith(min(component, key=len)) for c in component):
        found.append(f"import cycle: {' -> '.join(sorted(component))}")

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def the_graph() -> dict[str, set[str]]:
  mods = modules()
  return {name: imports(path, set(mods)) for name, path in mods.items()}


def test_the_house_has_no_cycle_and_no_upward_edge():
  problems = violations(the_graph(), LAYERS)
  assert not problems, "\n".join(problems)


def test_a_planted_cycle_and_an_upward_edge_are_found():
  graph = the_graph()
  graph["tpustrat._src.values"] = graph["tpustrat._src.values"] | {"tpustrat._src.engine"}  # engine -> values
  problems = violations(graph, LAYERS)
  assert any(p.startswith("upward edge: tpustrat._src.values") for p in problems), problems
  assert any(p.startswith("import cycle:") and "tpustrat._src.values" in p for p in problems), problems
  same_layer = {"a.x": {"a.y"}, "a.y": {"a.x"}}
  assert violations(same_layer, [("a",)]) == ["import cycle: a.x -> a.y"]


def test_lazy_and_type_checking_imports_count(tmp_path):
  source = tmp_path / "tpustrat" / "_src" / "m.py"
  source.parent.mkdir(parents=True)
  source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from tpustrat._src import a\n"
                    "def f():\n  import tpustrat._src.b\n")
  global ROOT
  saved, ROOT = ROOT, tmp_path / "tpustrat"
  try:
    assert imports(source, {"tpustrat._src.a", "tpustrat._src.b", "tpustrat._src.m"}) == {
        "tpustrat._src.a", "tpustrat._src.b"}
  finally:
    ROOT = saved


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_imports_another_modules_private_name(name):
  path = modules()[name]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpustrat"):
      private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
      assert not private, f"{name} imports private names {private} from {node.module}"
