"""`tpustrat._src.jax_compat`: the one module that touches JAX internals. Each function's behaviour is
checked on real jaxprs, so that a JAX upgrade that changes an internal fails here, by name, first.

Tested with JAX 0.10.2 (Python 3.11) and JAX 0.12.0.1 (Python 3.12).
"""

import re
import tomllib
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import jax_compat as compat


def test_jax_version_is_in_the_tested_range():
  """Written for JAX 0.10.2 (the lower bound, on Python 3.11) to 0.12.0.1 (on Python 3.12); no upper bound:
  a newer JAX that changes an internal should fail one of the tests below, not the library at random."""
  assert jax.__version_info__ >= compat.MIN_JAX_VERSION == (0, 10, 2)
  assert compat.TESTED_JAX_VERSIONS[0] == "0.10.2" and all(
      tuple(int(p) for p in v.split(".")) >= compat.MIN_JAX_VERSION for v in compat.TESTED_JAX_VERSIONS)
  pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
  deps = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in pyproject["project"]["dependencies"]}
  lower = ".".join(map(str, compat.MIN_JAX_VERSION))
  assert deps["jax"] == f"jax>={lower}" and deps["jaxlib"] == f"jaxlib>={lower}"  # and no upper bound


# -- varying axes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def test_varying_axes_inside_shard_map(mesh):
  seen = {}

  def body(x, y):
    seen["x"] = compat.varying_axes(x)
    seen["y"] = compat.varying_axes(y)
    seen["x+y"] = compat.varying_axes(x + y)
    seen["psum_a"] = compat.varying_axes(lax.psum(x + y, "a"))
    seen["psum_ab"] = compat.varying_axes(lax.psum(x + y, ("a", "b")))
    seen["aval"] = compat.aval_varying_axes(jax.typeof(x))
    return x + y

  f = jax.shard_map(body, mesh=mesh, in_specs=(P("a"), P(None, "b")), out_specs=P("a", "b"))
  jax.jit(f)(jnp.ones((2, 4)), jnp.ones((2, 4)))
  assert seen == {"x": {"a"}, "y": {"b"}, "x+y": {"a", "b"}, "psum_a": {"b"}, "psum_ab": set(),
                  "aval": {"a"}}
  assert all(isinstance(v, frozenset) for v in seen.values())


def test_varying_axes_outside_shard_map():
  assert compat.varying_axes(jnp.ones(3)) == frozenset()
  assert compat.varying_axes(np.float32(1.0)) == frozenset()
  seen = []
  jax.jit(lambda x: seen.append(compat.varying_axes(x)) or x)(1.0)  # traced, outside shard_map
  assert seen == [frozenset()]


# -- identity_primitive ----------------------------------------------------------------------------------


class _Unplaced(Exception):
  pass


_mark = compat.identity_primitive("tpustrat_test_mark", lambda *, tag: _Unplaced(f"mark {tag} left"))


def test_identity_primitive_is_an_identity_under_transformations():
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(_mark.bind(x, tag=1), x)
  g = jax.grad(lambda y: jnp.sum(jnp.sin(_mark.bind(y, tag=1))))(x)
  np.testing.assert_allclose(g, np.cos(np.arange(3.0)), rtol=1e-6)
  v = jax.vmap(lambda y: _mark.bind(y * 2.0, tag=1))(jnp.ones((4, 3)))
  np.testing.assert_array_equal(v, 2 * np.ones((4, 3)))


def test_identity_primitive_is_found_in_the_jaxpr_and_cannot_be_compiled():
  closed = jax.make_jaxpr(lambda y: _mark.bind(y * 2.0, tag=7))(1.0)
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is _mark]
  assert eqn.params == {"tag": 7}
  closed = jax.make_jaxpr(jax.vmap(jax.grad(lambda y: _mark.bind(jnp.sin(y), tag=3))))(jnp.ones(2))
  assert any(e.primitive is _mark for e in closed.jaxpr.eqns)  # kept by grad (its forward) and vmap
  with pytest.raises(_Unplaced, match="mark 7 left"):
    jax.jit(lambda y: _mark.bind(y * 2.0, tag=7))(1.0)


# -- jaxpr atoms and jaxprs ------------------------------------------------------------------------------


def test_atoms():
  closed = jax.make_jaxpr(lambda x: x * 2.0 + 1)(jnp.ones(3, jnp.float32))
  mul, add = closed.jaxpr.eqns
  x, two = mul.invars
  assert compat.is_var(x) and not compat.is_literal(x) and not compat.is_drop_var(x)
  assert compat.is_literal(two) and not compat.is_var(two) and compat.literal_value(two) == 2.0
  assert compat.is_literal(add.invars[1]) and compat.literal_value(add.invars[1]) == 1
  out = mul.outvars[0]
  assert compat.is_var(out) and not compat.is_drop_var(out)
  drop = jex_core.DropVar(jax.typeof(jnp.ones(3)))
  assert compat.is_drop_var(drop) and compat.is_var(drop) and not compat.is_literal(drop)


def test_sub_jaxprs():
  closed = jax.make_jaxpr(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, jax.jit(jnp.tanh)(x)))(1.0)
  by_name = {e.primitive.name: e for e in closed.jaxpr.eqns}
  assert compat.sub_jaxprs(by_name["gt"]) == []
  (body,) = compat.sub_jaxprs(by_name["jit"])
  assert [e.primitive.name for e in body.eqns] == ["tanh"]
  branches = compat.sub_jaxprs(by_name["cond"])
  assert sorted(e.primitive.name for b in branches for e in b.eqns) == ["cos", "sin"]


def test_jaxpr_from_equations_and_eval_jaxpr():
  closed = jax.make_jaxpr(lambda x, y: jnp.sin(x) * y + x)(1.0, 2.0)
  sin, mul, add = closed.jaxpr.eqns
  x, y = closed.jaxpr.invars
  info = compat.unnamed_debug_info(closed.jaxpr)
  part = compat.jaxpr_from_equations([sin, mul], [x, y], [mul.outvars[0], sin.outvars[0]], info)
  assert part.invars == [x, y] and part.constvars == [] and len(part.eqns) == 2
  got = compat.eval_jaxpr(part, [0.5, 3.0])
  np.testing.assert_allclose(got, [np.sin(0.5) * 3.0, np.sin(0.5)], rtol=1e-6)
  got = jax.jit(lambda a, b: compat.eval_jaxpr(part, [a, b]))(0.5, 3.0)  # in another trace, too
  np.testing.assert_allclose(got, [np.sin(0.5) * 3.0, np.sin(0.5)], rtol=1e-6)
  whole = compat.jaxpr_from_equations(closed.jaxpr.eqns, [x, y], [add.outvars[0]], info)
  np.testing.assert_allclose(compat.eval_jaxpr(whole, [0.5, 3.0])[0], np.sin(0.5) * 3 + 0.5, rtol=1e-6)


def test_close_and_open_jaxpr():
  c = jnp.arange(3.0)
  closed = jax.make_jaxpr(lambda x: x * 2.0 + c)(jnp.ones(3))  # c is a constant of the jaxpr
  jaxpr, consts = compat.open_jaxpr(closed)
  assert len(consts) == len(jaxpr.constvars) == 1 and len(jaxpr.invars) == 1
  np.testing.assert_array_equal(consts[0], np.arange(3.0))
  again = compat.close_jaxpr(jaxpr, consts)
  assert list(again.jaxpr.eqns) == list(jaxpr.eqns) and again.jaxpr.invars == jaxpr.invars
  assert len(again.consts) == 1 and again.jaxpr.constvars == jaxpr.constvars
  j2, c2 = compat.open_jaxpr(again)
  assert list(j2.eqns) == list(jaxpr.eqns) and len(c2) == 1
  # Evaluated with its constants: constvars then invars are the inputs of the same equations.
  flat = compat.jaxpr_from_equations(jaxpr.eqns, [*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars,
                                     compat.unnamed_debug_info(jaxpr))
  np.testing.assert_array_equal(compat.eval_jaxpr(flat, [*c2, jnp.ones(3)])[0], 2 + np.arange(3.0))
  # An open jaxpr (no constants) opens to itself.
  bare = compat.jaxpr_from_equations(jaxpr.eqns[:1], jaxpr.invars, jaxpr.eqns[0].outvars, flat.debug_info)
  j3, c3 = compat.open_jaxpr(bare)
  assert c3 == [] and list(j3.eqns) == list(bare.eqns)


def test_bind_equation():
  closed = jax.make_jaxpr(lambda x, y: (x + y, lax.sort((x, y), num_keys=1)))(jnp.ones(3), jnp.ones(3))
  add, sort = closed.jaxpr.eqns
  a, b = jnp.asarray([3.0, 1.0, 2.0]), jnp.asarray([30.0, 10.0, 20.0])
  (s,) = compat.bind_equation(add, [a, b])
  np.testing.assert_array_equal(s, [33.0, 11.0, 22.0])
  keys, vals = compat.bind_equation(sort, [a, b])  # a primitive with several results
  np.testing.assert_array_equal(keys, [1.0, 2.0, 3.0])
  np.testing.assert_array_equal(vals, [10.0, 20.0, 30.0])


@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "custom_jvp", "custom_vjp"])
def test_call_body(wrap):
  @jax.custom_vjp
  def twice(y):
    return y * 2.0

  twice.defvjp(lambda y: (twice(y), None), lambda _, ct: (ct * 2.0,))
  calls = {"jit": jax.jit(lambda y, z: jnp.sin(y) * z),
           "checkpoint": jax.checkpoint(lambda y, z: jnp.sin(y) * z),
           "custom_jvp": lambda y, z: jax.nn.relu(y) * z,
           "custom_vjp": lambda y, z: twice(y) * z}
  closed = jax.make_jaxpr(calls[wrap])(jnp.ones(3), jnp.ones(3))
  (eqn,) = [e for e in closed.jaxpr.eqns if compat.call_body(e) is not None]
  jaxpr, consts = compat.call_body(eqn)
  assert len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars)
  a, b = jnp.asarray([-1.0, 0.5, 2.0]), jnp.asarray([1.0, 2.0, 3.0])
  args = [a, b][:len(eqn.invars)]
  inner = compat.jaxpr_from_equations(jaxpr.eqns, [*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars,
                                      compat.unnamed_debug_info(jaxpr))
  np.testing.assert_allclose(compat.eval_jaxpr(inner, [*consts, *args]), compat.bind_equation(eqn, args),
                             rtol=1e-6, atol=1e-7)


def test_call_body_is_none_for_other_primitives():
  f = lambda x: lax.scan(lambda c, t: (c + t, c), x, jnp.arange(2.0))[0] + jnp.sin(x)
  closed = jax.make_jaxpr(f)(jnp.ones(2))
  assert [compat.call_body(e) for e in closed.jaxpr.eqns] == [None] * len(closed.jaxpr.eqns)


def test_is_sharding_constraint(mesh):
  closed = jax.make_jaxpr(lambda x: lax.with_sharding_constraint(jnp.sin(x), NamedSharding(mesh, P("a"))))(
      jnp.ones(8))
  assert [compat.is_sharding_constraint(e) for e in closed.jaxpr.eqns] == [False, True]


def test_collective_axes(mesh):
  def body(x):
    s = lax.psum(x, "a")
    m = lax.pmax(x, ("a", "b"))
    g = lax.all_gather(x, "b")
    p = lax.ppermute(x, "a", [(0, 1), (1, 0)])
    return jnp.sin(s + m + g.sum(0) + p)

  f = jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")))
  closed = jax.make_jaxpr(f)(jnp.ones(8))
  (inner,) = compat.sub_jaxprs(closed.jaxpr.eqns[-1])
  axes = {e.primitive.name: compat.collective_axes(e) for e in inner.eqns}
  named = lambda prefix: [v for k, v in axes.items() if k.startswith(prefix)]  # psum: psum_invariant
  assert named("psum") == [("a",)] and named("all_gather") == [("b",)]
  assert axes["pmax"] == ("a", "b") and axes["ppermute"] == ("a",)
  assert axes["sin"] is None and axes["add"] is None and axes["reduce_sum"] is None  # `axes`, not mesh axes


# -- lax.scan --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reverse, unroll", [(False, 1), (True, 2)])
def test_scan_signature(reverse, unroll):
  def f(k, c0, d0, xs):
    def body(carry, x):
      c, d = carry
      return (c * x + k, d + 1.0), (c.sum(), x, d * k)  # `x` as a y: JAX forwards it outside the loop
    return lax.scan(body, (c0, d0), xs, reverse=reverse, unroll=unroll)

  xs = jnp.arange(1.0, 5.0, dtype=jnp.float32)[:, None] * jnp.ones(3)
  args = (jnp.float32(0.5), jnp.ones(3), jnp.float32(0.0), xs)
  closed = jax.make_jaxpr(f)(*args)
  (eqn,) = [e for e in closed.jaxpr.eqns if compat.is_scan(e)]
  assert not any(compat.is_scan(e) for e in closed.jaxpr.eqns if e is not eqn)
  sig = compat.scan_signature(eqn)
  assert (sig.num_carry, sig.length, sig.reverse) == (2, 4, reverse)
  assert sig.unroll in (unroll, bool(unroll)) or int(sig.unroll) == unroll
  body = sig.body.jaxpr
  assert len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars)
  assert len(eqn.invars) == sig.num_consts + sig.num_carry + 1  # one scanned-over array
  assert sig.num_consts >= 1  # `k`

  # Re-emitting the scan from its signature gives the original's results.
  def replay(*flat):
    consts = flat[:sig.num_consts]
    init, xs = flat[sig.num_consts:sig.num_consts + sig.num_carry], flat[sig.num_consts + sig.num_carry:]
    step = compat.jaxpr_from_equations(body.eqns, [*body.constvars, *body.invars], body.outvars,
                                       compat.unnamed_debug_info(body))

    def one(carry, x):
      outs = compat.eval_jaxpr(step, [*sig.body.consts, *consts, *carry, *x])
      return outs[:sig.num_carry], outs[sig.num_carry:]

    carry, ys = lax.scan(one, list(init), list(xs), length=sig.length, reverse=sig.reverse, unroll=sig.unroll)
    return [*carry, *ys]

  env = dict(zip(closed.jaxpr.invars, args))
  env.update(zip(closed.jaxpr.constvars, closed.consts))
  for e in closed.jaxpr.eqns:
    ins = [compat.literal_value(v) if compat.is_literal(v) else env[v] for v in e.invars]
    env.update(zip(e.outvars, replay(*ins) if e is eqn else compat.bind_equation(e, ins)))
  got = [env[v] for v in closed.jaxpr.outvars]
  want = jax.tree.leaves(f(*args))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_scan_signature_of_an_unknown_layout_is_a_clear_error():
  closed = jax.make_jaxpr(lambda x: lax.scan(lambda c, t: (c + t, c), x, jnp.arange(2.0)))(1.0)
  (eqn,) = [e for e in closed.jaxpr.eqns if compat.is_scan(e)]
  params = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry", "ft_in", "ft_out")}
  with pytest.raises(NotImplementedError, match="scan_signature needs updating"):
    compat.scan_signature(types.SimpleNamespace(primitive=eqn.primitive, params=params))


def test_rewrite_equations_replaces_equations_at_any_depth_and_keeps_the_rest():
  """An equation replaced inside a scan inside a cond inside a jit: the rewritten jaxpr evaluates to the
  replacement's values; the same object when nothing is replaced; a sub-jaxpr used twice rewritten once."""
  def f(x):
    inner = jax.jit(lambda y: jnp.sin(y) * 2.0)
    body = lambda c, y: (c + inner(y).sum(), inner(y))
    return lax.cond(x.sum() > 0, lambda: lax.scan(body, 0.0, x), lambda: (0.0, x)), inner(x)

  x = jnp.arange(1.0, 7.0).reshape(3, 2)
  closed = jax.make_jaxpr(f)(x)

  def cos_for_sin(eqn):
    if eqn.primitive is not lax.sin_p:
      return None
    return [eqn.replace(primitive=lax.cos_p, params={k: v for k, v in eqn.params.items() if k == "accuracy"})]

  rewritten = compat.rewrite_equations(closed, cos_for_sin)
  assert compat.rewrite_equations(closed, lambda eqn: None) is closed
  jaxpr, consts = compat.open_jaxpr(rewritten)
  (carry, ys), direct = jax.tree.unflatten(jax.tree.structure(f(x)), compat.eval_closed_jaxpr(jaxpr, consts, [x]))
  cos = np.cos(np.asarray(x)) * 2.0
  np.testing.assert_allclose(ys, cos, rtol=1e-6)
  np.testing.assert_allclose(direct, cos, rtol=1e-6)
  np.testing.assert_allclose(carry, cos.sum(), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 8])
def test_sharded_put_makes_the_array_make_array_from_callback_makes(n):
  """JAX's private batched transfer (`sharded_put`) is found on the tested JAX versions (no warning, which
  the suite turns into an error), and gives the array of `jax.make_array_from_callback` (values, dtype,
  sharding, each device's slice, committed) for split and replicated shardings and every kind of dtype,
  those that fall back to the public call (64-bit, narrowed by JAX) included."""
  assert compat._batched_put() is not None  # noqa: SLF001
  mesh = Mesh(np.array(jax.devices()[:n]), ("replica",))
  rng = np.random.default_rng(0)
  for spec in (P("replica"), P(None, "replica"), P()):
    sharding = NamedSharding(mesh, spec)
    for dtype in (np.float32, np.int32, np.bool_, np.int8, np.uint8, np.float16, jnp.bfloat16, np.complex64,
                  np.float64, np.int64):
      x = (rng.normal(size=(8, 16, 3)) * 10).astype(dtype)
      got = compat.sharded_put(x.shape, x.dtype, sharding)(x)
      want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
      assert (got.dtype, got.shape, got.sharding, got.committed) == (want.dtype, want.shape, want.sharding, True)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(x).astype(want.dtype))
      for a, b in zip(got.addressable_shards, want.addressable_shards):
        assert (a.device, a.index) == (b.device, b.index)
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
