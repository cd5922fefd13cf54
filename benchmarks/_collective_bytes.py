"""The collectives of a compiled program and the bytes they send between domains (hosts, slices, groups).

Read from the program's HLO text (``jax.jit(...).lower(...).compile().as_text()``, or the program
`strategy.run` compiles): each all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute,
its result shape and its replica groups (explicit ``{{0,1},{2,3}}``, XLA's iota form ``[2,4]<=[8]`` /
``[4,2]<=[2,4]T(1,0)``, the mesh form jit's partitioner writes, ``mesh['axis_0'=4,'axis_1'=2],
device_ids=([2,4]T(1,0)) {'axis_0'}``, or ``{}``: every device), and how many times it runs per run of the program (a
collective in a loop's body, a `lax.scan` over layers, runs once per iteration: XLA's
``known_trip_count`` of the ``while``; a loop without one counts once). Device ids are positions in the
program's device assignment: for `strategy.run`, replica ids.

`cross_domain_bytes` counts what the devices send to devices of other domains, when each collective sends
every member's share to the member that needs it (the bandwidth-optimal volume per device, the volume of a
ring or of direct sends, attributed to destinations). Per device ``d`` of a group of ``m`` members, ``k`` of
them outside ``d``'s domain:

* all-gather of result ``O`` bytes: ``d``'s piece (``O / m``) to each of the ``k``: ``k * O / m``;
* reduce-scatter of result ``B`` bytes (input ``m * B``): the piece of each of the ``k``: ``k * B``;
* all-reduce of ``A`` bytes (reduce-scatter, then all-gather): ``2 * k * A / m``;
* all-to-all of ``A`` bytes: ``k * A / m``; collective-permute: ``A`` for each pair across domains.

A two-level (hierarchical) all-reduce, as NCCL's on several nodes, sends less across them for a group
spanning domains (an all-reduce within each domain, then one across on ``1/m_D`` of the bytes): the model
is that of XLA's flat collectives over the groups the program names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

__all__ = ["Collective", "collectives", "cross_domain_bytes", "domain_of"]

_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?P<start>-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
         "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a program: its kind, the bytes of its result per device (for an async start, of the
  result it completes), and its groups of device ids (None: every device; for collective-permute, the
  (source, target) pairs)."""

  op: str
  nbytes: int
  groups: tuple[tuple[int, ...], ...] | None
  count: int = 1  # runs per run of the program (inside loops: their trip counts multiplied)


def _array_bytes(text: str) -> list[int]:
  text = re.sub(r"/\*.*?\*/", "", text)  # XLA's /*index=5*/ comments in long tuples
  out = []
  for m in _ARRAY.finditer(text):
    dims = [int(d) for d in m.group("dims").split(",") if d]
    out.append(int(np.prod(dims, dtype=np.int64)) * _BITS[m.group("dtype")] // 8)
  return out


_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*"
                   r"\{(?P<over>[^}]*)\}")


def _iota(dims: list[int], transpose: str | None) -> np.ndarray:
  """XLA's iota device list ``[dims]T(perm)``: ``arange`` reshaped to `dims`, transposed by `perm`."""
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  return ids.transpose([int(x) for x in transpose.split(",")]) if transpose else ids


def _mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
  """XLA's mesh form, ``replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``: the devices
  (`device_ids`, an iota list; without it, in order) laid out on the mesh's axes, one group per position on
  the other axes, its members along the named ones."""
  axes = re.findall(r"'([^']+)'=([0-9]+)", m.group("axes"))
  names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
  ids = np.arange(int(np.prod(sizes)))
  if m.group("ids"):
    iota = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", m.group("ids"))
    assert iota is not None, m.group(0)
    ids = _iota([int(x) for x in iota.group(1).split(",")], iota.group(2))
  over = re.findall(r"'([^']+)'", m.group("over"))
  assert over and all(a in names for a in over) and len(over) == len(m.group("over").split(",")), m.group(0)
  rest = [names.index(a) for a in names if a not in over]
  grid = ids.reshape(sizes).transpose(rest + [names.index(a) for a in over])
  return tuple(tuple(int(x) for x in row) for row in grid.reshape(-1, int(np.prod([sizes[names.index(a)] for a in over]))))


def _groups(line: str, field: str) -> tuple[tuple[int, ...], ...] | None:
  if field == "replica_groups" and (mesh := _MESH.search(line)):
    return _mesh_groups(mesh)
  m = re.search(field + r"=(\{\{[0-9,{} ]*\}\}|\{\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)", line)
  if m is None or m.group(1) == "{}":
    return None
  text = m.group(1)
  if text.startswith("{{"):
    return tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([0-9, ]*)\}", text[1:-1]))
  iota = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
  assert iota is not None, text
  shape = [int(x) for x in iota.group(1).split(",")]
  ids = _iota([int(x) for x in iota.group(2).split(",")], iota.group(3))
  return tuple(tuple(int(x) for x in row) for row in ids.reshape(shape[0], -1))


_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>[^ (]+) \(.*\{\s*$")
_CALLS = re.compile(r"(?P<kind>body|condition|to_apply|calls|true_computation|false_computation)=%(?P<name>[^ ,)}]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIPS = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(?P<n>[0-9]+)"')


def _run_counts(lines: list[str]) -> dict[str, int]:
  """How many times each computation of the HLO runs per run of its entry computation."""
  edges: dict[str, list[tuple[str, int]]] = {}
  entry, current = None, None
  for line in lines:
    header = _HEADER.match(line)
    if header:
      current = header.group("name")
      edges.setdefault(current, [])
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    trips = _TRIPS.search(line)
    for m in _CALLS.finditer(line):
      factor = int(trips.group("n")) if trips and m.group("kind") == "body" else 1
      edges[current].append((m.group("name"), factor))
    for m in _BRANCHES.finditer(line):
      edges[current].extend((n.strip().lstrip("%"), 1) for n in m.group("names").split(",") if n.strip())
  counts: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    counts[name] = counts.get(name, 0) + times
    for callee, factor in edges.get(name, ()):
      visit(callee, times * factor)

  if entry is not None:
    visit(entry, 1)
  return counts


def collectives(hlo: str) -> list[Collective]:
  """Every collective of the HLO text (the ``-done`` halves of async pairs left out), in program order,
  with how many times it runs per run of the program."""
  found = []
  lines = hlo.splitlines()
  runs = _run_counts(lines)
  current = None
  for line in lines:
    header = _HEADER.match(line)
    if header:
      current = header.group("name")
      continue
    m = _LINE.search(line)
    if m is None:
      continue
    sizes = _array_bytes(m.group("shape"))
    op = m.group("op")
    # an async all-gather / collective-permute start returns (operand, result, ...): the result's bytes
    nbytes = sizes[1] if m.group("start") and op in ("all-gather", "collective-permute") else sum(sizes)
    field = "source_target_pairs" if op == "collective-permute" else "replica_groups"
    found.append(Collective(op, nbytes, _groups(line, field), runs.get(current, 1) if current else 1))
  return found


def domain_of(domains: Sequence[Sequence[int]]) -> dict[int, int]:
  """Device id -> index of its domain."""
  return {int(d): i for i, dom in enumerate(domains) for d in dom}


def cross_domain_bytes(hlo_or_collectives: str | Sequence[Collective], domains: Sequence[Sequence[int]]) -> dict[str, int]:
  """Bytes the program's devices send to devices of other `domains` (lists of device ids: one per host,
  slice or group) in one run, per kind of collective and in all (``"total"``): see the module docstring for
  the model. A collective whose groups say "every device" (None) spans every device of `domains`."""
  found = collectives(hlo_or_collectives) if isinstance(hlo_or_collectives, str) else hlo_or_collectives
  where = domain_of(domains)
  everyone = tuple(sorted(where))
  out = {op: 0 for op in _OPS}
  for c in found:
    if c.op == "collective-permute":
      out[c.op] += c.count * sum(c.nbytes for s, t in (c.groups or ()) if where[s] != where[t])
      continue
    for group in (c.groups if c.groups is not None else (everyone,)):
      m = len(group)
      for d in group:
        k = sum(where[o] != where[d] for o in group)
        if c.op == "all-gather":
          out[c.op] += c.count * k * c.nbytes // m
        elif c.op == "reduce-scatter":
          out[c.op] += c.count * k * c.nbytes
        elif c.op == "all-reduce":
          out[c.op] += c.count * 2 * k * c.nbytes // m
        else:
          out[c.op] += c.count * k * c.nbytes // m
  out["total"] = sum(out[op] for op in _OPS)
  return out
