"""Convolutions inside compiled loops on XLA:CPU, laid out for its fast kernel before XLA sees the loop.

XLA:CPU runs a convolution through Eigen's multithreaded kernel only when its dimension numbers are
canonical: the input ``(batch, spatial..., feature)``, the kernel ``(spatial..., in, out)``, the output
``(batch, spatial..., feature)`` (NHWC / HWIO for 2-D). Its ``ConvCanonicalization`` pass puts every other
convolution in that form, between two transposes, but only in the program's entry computation
(``module->entry_computation()`` in ``xla/service/cpu/conv_canonicalization.cc``): a convolution in the body
of a loop or a branch keeps its dimension numbers and runs through XLA's generic loop-nest emitter. Every
convolution's weight gradient (JAX's transpose rule: ``f01b_i01o->01bf`` for an NHWC step) has such numbers,
so a convolutional training step written as `experimental_run_steps`' `lax.scan` or `accumulate_gradients`'
micro-batch loop ran 4-6x slower on a CPU than as a program of its own (measured in
docs/benchmarks.md, "Steps per program").

`canonical_convolutions(fn)` is ``fn`` traced to a jaxpr once, each convolution in it (at any depth) with
other dimension numbers rewritten as XLA's pass would rewrite it (transpose the operands, convolve in the
canonical numbers, transpose the result back: the same values, the dimensions permuted), and evaluated
into the current trace: the body of a loop then holds convolutions XLA:CPU runs on its fast kernel. The
loops tpustrat builds use it on a CPU only (`on_cpu`); GPU and TPU compilers choose convolution layouts
in every computation themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from tpustrat._src import jax_compat

__all__ = ["canonical_convolutions", "on_cpu"]


def on_cpu(devices: Any) -> bool:
  """Whether the program runs on XLA:CPU: `devices` (a mesh's, or None for JAX's default backend)."""
  if devices is None:
    return jax.default_backend() == "cpu"
  first = next(iter(np.asarray(devices).flat))
  return first.platform == "cpu"


def _canonical_numbers(rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  spatial = tuple(range(1, rank - 1))
  return (0, rank - 1, *spatial), (rank - 1, rank - 2, *range(rank - 2)), (0, rank - 1, *spatial)


def _unsharded(aval_or_sharding: Any) -> bool:
  """Whether an abstract value (or a convolution's ``out_sharding``) names no mesh axis on any dimension:
  then it reads the same with its dimensions permuted (the names would have to be permuted too)."""
  sharding = getattr(aval_or_sharding, "sharding", aval_or_sharding)
  spec = getattr(sharding, "spec", None)
  return spec is None or all(s is None for s in spec)


def _permuted(var: Any, permutation: tuple[int, ...]) -> Any:
  aval = var.aval
  return jax_compat.new_var(aval.update(shape=tuple(aval.shape[p] for p in permutation)))


def _canonical(eqn: Any) -> list[Any] | None:
  """A convolution equation with non-canonical dimension numbers as transpose, canonical convolution,
  transpose (XLA:CPU's ``ConvCanonicalization``, done here); None for any other equation, and for one
  this cannot rewrite exactly (a result nothing reads, a literal operand, an array or output sharding
  that names mesh axes)."""
  if eqn.primitive is not lax.conv_general_dilated_p:
    return None
  numbers = eqn.params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = (tuple(s) for s in numbers)
  rank = len(lhs_spec)
  if (lhs_spec, rhs_spec, out_spec) == _canonical_numbers(rank):
    return None
  (lhs, rhs), (out,) = eqn.invars, eqn.outvars
  if (jax_compat.is_drop_var(out) or not (jax_compat.is_var(lhs) and jax_compat.is_var(rhs))
      or not _unsharded(eqn.params.get("out_sharding")) or not all(_unsharded(v.aval) for v in (lhs, rhs, out))):
    return None
  lhs_order = (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])  # (batch, spatial..., feature)
  rhs_order = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])  # (spatial..., in, out)
  out_order = (out_spec[0], *out_spec[2:], out_spec[1])
  lhs_t, rhs_t, out_t = _permuted(lhs, lhs_order), _permuted(rhs, rhs_order), _permuted(out, out_order)
  lhs_c, rhs_c, out_c = _canonical_numbers(rank)
  params = dict(eqn.params, dimension_numbers=lax.ConvDimensionNumbers(lhs_spec=lhs_c, rhs_spec=rhs_c,
                                                                       out_spec=out_c))
  back = tuple(int(i) for i in np.argsort(out_order))
  transpose = jax_compat.transpose_equation
  return [transpose(lhs, lhs_order, lhs_t, eqn), transpose(rhs, rhs_order, rhs_t, eqn),
          eqn.replace(invars=[lhs_t, rhs_t], outvars=[out_t], params=params),
          transpose(out_t, back, out, eqn)]


def canonical_convolutions(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` (of pytrees of arrays, returning one), its convolutions in XLA:CPU's canonical layout: traced
  once to a jaxpr, rewritten (`_canonical`, at any depth) and evaluated into the current trace. For the
  body of a loop compiled for a CPU; `fn` is traced once, as it would be."""

  @functools.wraps(fn)
  def canonical(*args: Any) -> Any:
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, consts = jax_compat.open_jaxpr(jax_compat.rewrite_equations(closed, _canonical))
    out = jax_compat.eval_closed_jaxpr(jaxpr, consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shapes), out)

  return canonical
