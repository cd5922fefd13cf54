"""strategy.run: SPMD execution, Mirrored/PerReplica inference, caching, pytrees, in-flight bound."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, backend_compiles

import tpustrat
from tpustrat._src.values import Mirrored, PerReplica

N = 8


def stacked(strategy, arr):
  """A PerReplica from an [N, ...] numpy array, via values_from_function."""
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: arr[ctx.replica_id_in_sync_group])


def test_per_replica_args_give_each_replica_its_component(strategy, rng):
  x = rng.normal(size=(N, 3)).astype(np.float32)
  out = strategy.run(lambda v: v * 2.0 + 1.0, args=(stacked(strategy, x),))
  assert isinstance(out, PerReplica)
  np.testing.assert_allclose(np.stack(strategy.experimental_local_results(out)), x * 2 + 1, rtol=1e-6)


def test_broadcast_args_plain_arrays_scalars_and_mirrored(strategy, rng):
  w = rng.normal(size=(3,)).astype(np.float32)
  x = rng.normal(size=(N, 3)).astype(np.float32)
  mirrored = strategy.run(lambda: jnp.asarray(w))  # invariant output -> Mirrored
  assert isinstance(mirrored, Mirrored)

  def fn(x, w_plain, w_mirrored, scale):
    return x * w_plain + w_mirrored * scale

  out = strategy.run(fn, args=(stacked(strategy, x), w, mirrored, 3.0))
  # Two products and a sum (XLA may fuse them into an FMA): rounding relative to the products.
  assert_close(np.stack(out.values), x.astype(np.float64) * w + w * 3.0, rtol=1e-6,
               scale=np.abs(x * w) + np.abs(w * 3.0))


def test_mirrored_output_is_replicated_not_stacked(strategy, rng):
  x = rng.normal(size=(N, 4)).astype(np.float32)

  def fn(v):
    ctx = tpustrat.get_replica_context()
    return ctx.all_reduce(tpustrat.ReduceOp.SUM, v), v

  total, same = strategy.run(fn, args=(stacked(strategy, x),))
  assert isinstance(total, Mirrored) and isinstance(same, PerReplica)
  arr = total.tree
  assert arr.shape == (4,)  # one copy of the value, not [N, 4]
  assert arr.sharding.is_fully_replicated
  assert len(arr.addressable_shards) == N and all(s.data.shape == (4,) for s in arr.addressable_shards)
  for component in strategy.experimental_local_results(total):
    assert_close(component, x.astype(np.float64).sum(0), scale=np.abs(x).sum(0))
  per_replica = same.tree
  assert per_replica.shape == (N, 4) and per_replica.sharding.spec == jax.sharding.PartitionSpec("replica")


def test_pytree_arguments_and_results(strategy, rng):
  params = {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
  xs = rng.normal(size=(N, 5, 3)).astype(np.float32)

  def fn(p, batch, *, extra):
    y = batch["x"] @ p["w"] + p["b"]
    ctx = tpustrat.get_replica_context()
    return {"y": y, "stats": (ctx.all_reduce("mean", y.mean()), extra + 1)}

  out = strategy.run(fn, args=(params, {"x": stacked(strategy, xs)}), kwargs={"extra": 1.0})
  assert isinstance(out["y"], PerReplica)
  assert isinstance(out["stats"][0], Mirrored) and isinstance(out["stats"][1], Mirrored)
  want = xs.astype(np.float64) @ params["w"] + params["b"]
  scale = np.abs(xs) @ np.abs(params["w"]) + np.abs(params["b"])
  assert_close(np.stack(out["y"].values), want, scale=scale)
  assert_close(out["stats"][0].values[0], want.mean(), scale=scale.mean())
  np.testing.assert_allclose(out["stats"][1].values[5], 2.0)


def test_optax_state_round_trips_as_mirrored(strategy, rng):
  params = {"w": jnp.asarray(rng.normal(size=(4,)).astype(np.float32))}
  tx = optax.adam(0.1)
  xs = rng.normal(size=(N, 6, 4)).astype(np.float32)

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2) / (N * 6))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  new_params, new_state = strategy.run(step, args=(params, tx.init(params), stacked(strategy, xs)))
  assert all(isinstance(leaf, Mirrored) for leaf in jax.tree.leaves(
      (new_params, new_state), is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues)))
  # Reference: one device, the whole global batch.
  flat = xs.reshape(-1, 4)
  grads = jax.grad(lambda p: jnp.sum((flat @ p["w"]) ** 2) / flat.shape[0])(params)
  updates, _ = tx.update(grads, tx.init(params), params)
  want = optax.apply_updates(params, updates)
  assert_close(new_params["w"].values[0], want["w"], scale=np.abs(params["w"]) + 0.1)  # |w| + Adam's step


def test_replica_id_and_num_replicas(strategy):
  def fn():
    ctx = tpustrat.get_replica_context()
    assert ctx.num_replicas_in_sync == N and ctx.strategy is strategy
    assert tpustrat.get_strategy() is strategy and not tpustrat.in_cross_replica_context()
    return ctx.replica_id_in_sync_group

  out = strategy.run(fn)
  assert [int(v) for v in out.values] == list(range(N))


def test_all_reduce_sum_mean_and_gradient(strategy, rng):
  x = rng.normal(size=(N, 3)).astype(np.float32)
  c = rng.normal(size=(N, 3)).astype(np.float32)

  def fn(x, c):
    ctx = tpustrat.get_replica_context()
    s, m = ctx.all_reduce("SUM", x), ctx.all_reduce(tpustrat.ReduceOp.MEAN, {"a": x})["a"]
    # Per-replica objective L_r = sum(c_r * all_reduce_sum(x)**2); total objective is sum_r L_r.
    g = jax.grad(lambda x: jnp.sum(c * ctx.all_reduce("sum", x) ** 2))(x)
    return s, m, g

  s, m, g = strategy.run(fn, args=(stacked(strategy, x), stacked(strategy, c)))
  assert_close(s.values[0], x.astype(np.float64).sum(0), scale=np.abs(x).sum(0))
  assert_close(m.values[0], x.astype(np.float64).mean(0), scale=np.abs(x).mean(0))
  # d/dx_r sum_q c_q * S**2 = 2 * S * sum_q c_q, with S = sum_r x_r.
  want = 2 * x.astype(np.float64).sum(0) * c.astype(np.float64).sum(0)
  for component in g.values:
    assert_close(component, want, scale=2 * np.abs(x).sum(0) * np.abs(c).sum(0))


def test_all_gather_concatenates_in_replica_order(strategy, rng):
  x = rng.normal(size=(N, 2, 3)).astype(np.float32)

  def fn(v):
    ctx = tpustrat.get_replica_context()
    return ctx.all_gather(v, axis=0), ctx.all_gather(v, axis=-1)

  a0, a1 = strategy.run(fn, args=(stacked(strategy, x),))
  assert isinstance(a0, Mirrored)
  np.testing.assert_allclose(a0.values[0], np.concatenate(list(x), axis=0))
  np.testing.assert_allclose(a1.values[3], np.concatenate(list(x), axis=-1))


def test_compilation_is_cached_and_fn_traced_once(strategy, rng):
  traces = []

  def step(w, x):
    traces.append(1)
    ctx = tpustrat.get_replica_context()
    return w - 0.1 * ctx.all_reduce("mean", x * w), x.sum()

  x = stacked(strategy, rng.normal(size=(N, 4)).astype(np.float32))
  w = jnp.ones(4)
  for _ in range(50):
    w, _ = strategy.run(step, args=(w, x))
  assert len(traces) == 1
  # A new shape is a new signature: exactly one more trace, then cached again.
  x2 = stacked(strategy, rng.normal(size=(N, 5)).astype(np.float32))
  w2 = jnp.ones(5)
  for _ in range(10):
    w2, _ = strategy.run(step, args=(w2, x2))
  assert len(traces) == 2


def test_run_inside_outer_jit_and_scan(strategy, rng):
  xs = rng.normal(size=(N, 3)).astype(np.float32)
  x = stacked(strategy, xs)

  def step(w, x):
    return w + tpustrat.get_replica_context().all_reduce("sum", x)

  @jax.jit
  def many(w, x):
    return jax.lax.scan(lambda w, _: (strategy.run(step, args=(w, x)), None), w, None, length=3)[0]

  # The scan carry keeps its type: start from a Mirrored value, as run returns one.
  out = many(strategy.run(lambda: jnp.zeros(3)), x)
  assert isinstance(out, Mirrored)
  assert_close(out.values[0], 3 * xs.astype(np.float64).sum(0), scale=3 * np.abs(xs).sum(0))


def test_long_chain_of_steps_with_all_reduce_finishes(strategy):
  """5,000 chained steps on 8 CPU devices: unbounded dispatch would abort in XLA:CPU's rendezvous."""

  def step(w):
    ctx = tpustrat.get_replica_context()
    return w + ctx.all_reduce("sum", (ctx.replica_id_in_sync_group == 0).astype(w.dtype))  # 1 per step

  w = jnp.zeros(())
  for _ in range(5000):
    w = strategy.run(step, args=(w,))
  assert float(w.values[0]) == 5000.0


def test_max_steps_in_flight_option(strategy):
  assert strategy.extended.max_steps_in_flight == 2
  w = jnp.zeros(())
  for _ in range(20):
    w = strategy.run(lambda w: w + 1, args=(w,), options=tpustrat.RunOptions(max_steps_in_flight=1))
  assert float(w.values[0]) == 20.0
  with pytest.raises(ValueError, match="max_steps_in_flight"):
    tpustrat.RunOptions(max_steps_in_flight=0)
  with pytest.raises(ValueError, match="max_steps_in_flight"):
    strategy.extended.max_steps_in_flight = -1


def test_mirrored_inputs_are_not_copied_through_the_host(strategy):
  w = strategy.run(lambda: jnp.arange(4.0))
  before = w.tree
  out = strategy.run(lambda w: w * 1.0, args=(w,))
  # The input kept its replicated on-device sharding and no transfer was needed: same buffers.
  assert out.tree.sharding.is_fully_replicated and before.sharding == out.tree.sharding


# -- bad input -------------------------------------------------------------------------------------


def test_args_must_be_tuple_or_list(strategy):
  with pytest.raises(TypeError, match=r"`args` to be a tuple or list.*args=\(x,\)"):
    strategy.run(lambda x: x, args=np.ones(3))
  with pytest.raises(TypeError, match="kwargs"):
    strategy.run(lambda x: x, args=(1.0,), kwargs=[1])


def test_per_replica_with_wrong_number_of_components(strategy):
  traces = []

  def fn(x):
    traces.append(1)
    return x

  bad = tpustrat.PerReplica([np.ones(2, np.float32)] * 3)
  with pytest.raises(ValueError, match=r"has 3 components, but the strategy has 8 replicas"):
    strategy.run(fn, args=(bad,))
  assert not traces  # raised before tracing fn


def test_nested_run_is_an_error(strategy):
  def outer():
    return strategy.run(lambda: 1.0)

  with pytest.raises(RuntimeError, match="Nested run"):
    strategy.run(outer)


def test_all_reduce_outside_run_is_an_error(strategy):
  captured = []
  strategy.run(lambda: captured.append(tpustrat.get_replica_context()) or 0.0)
  with pytest.raises(RuntimeError, match="outside strategy.run"):
    captured[0].all_reduce("sum", 1.0)


def test_unknown_reduce_op_in_all_reduce(strategy):
  with pytest.raises(ValueError, match=r"Unknown reduce op 'max'"):
    strategy.run(lambda: tpustrat.get_replica_context().all_reduce("max", 1.0))


def test_non_array_result_is_a_type_error(strategy):
  with pytest.raises(TypeError, match="returned str"):
    strategy.run(lambda: "hello")


@pytest.mark.filterwarnings("ignore::tpustrat.RepeatedPlacementWarning")  # a plain array given on purpose
def test_program_cache_evicts_the_least_recently_used_and_holds_functions_weakly(monkeypatch):
  import gc
  import weakref

  from tpustrat._src.engine import engine as engine_lib  # the module of `Engine`, which reads its cache size

  monkeypatch.setattr(engine_lib, "_CACHE_SIZE", 2)
  small = tpustrat.TPUStrategy()
  traces = []

  def make(i):
    def step(x):
      traces.append(i)
      return x + i
    return step

  f0, f1, f2 = make(0), make(1), make(2)
  x = jnp.ones(3)
  for f in (f0, f1, f0, f2):  # f0 used after f1: f2 evicts f1, not f0 (first in, but used last)
    small.run(f, args=(x,))
  assert traces == [0, 1, 2]
  np.testing.assert_array_equal(small.run(f0, args=(x,)).values[0], np.ones(3))
  assert traces == [0, 1, 2]  # not traced again
  # The cache holds neither the function nor its closure.
  ref = weakref.ref(f2)
  del f2, f  # the loop variable holds it too
  gc.collect()
  assert ref() is None


def test_bound_methods_share_one_program():
  small = tpustrat.TPUStrategy()

  class Model:
    def __init__(self):
      self.traces = 0

    def step(self, x):
      self.traces += 1
      return x * 2

  m = Model()
  for _ in range(3):
    out = small.run(m.step, args=(jnp.arange(3.0),))  # a new bound-method object on every access
  assert m.traces == 1
  np.testing.assert_array_equal(out.values[0], np.arange(3.0) * 2)


@pytest.mark.parametrize("wrap", [tpustrat.PerReplica, tpustrat.Mirrored])
def test_run_rejects_a_distributed_value_returned_by_the_replica_function(strategy, wrap):
  inner = wrap([np.ones(2, np.float32)] * N) if wrap is tpustrat.PerReplica else wrap(np.ones(2, np.float32))

  def fn(x):
    return {"loss": x.sum(), "bad": inner}

  with pytest.raises(TypeError) as info:
    strategy.run(fn, (jnp.ones(3),))
  message = str(info.value)
  assert f"returned a {wrap.__name__} at ['bad']" in message
  assert "cross-replica" in message and "return the arrays instead" in message


def test_a_passed_through_output_is_a_fresh_buffer_written_by_the_step(strategy):
  # jax 0.10.2 does not forward a shard_map pass-through to the input's buffer: XLA copies it inside the
  # program, so waiting on it (as `engine.wait_leaf` may choose it) waits for the step.
  w = strategy.run(lambda: jnp.arange(4.0))
  x = stacked(strategy, np.arange(N * 3, dtype=np.float32).reshape(N, 3))
  out_w, total = strategy.run(lambda w, x: (w, x.sum()), (w, x))
  assert isinstance(out_w, tpustrat.Mirrored)
  np.testing.assert_array_equal(out_w.values[0], np.arange(4.0))
  in_ptrs = {s.data.unsafe_buffer_pointer() for s in w.tree.addressable_shards}
  out_ptrs = {s.data.unsafe_buffer_pointer() for s in out_w.tree.addressable_shards}
  assert not in_ptrs & out_ptrs
  np.testing.assert_array_equal(
      [float(v) for v in strategy.experimental_local_results(total)], np.arange(N * 3).reshape(N, 3).sum(1))


# -- 64-bit host integers without jax_enable_x64 ------------------------------------------------------

BIG = 3_000_000_000


def test_run_raises_on_a_host_int64_argument_beyond_int32_naming_its_path(strategy):
  assert not jax.config.jax_enable_x64
  traces = []

  def fn(w, batch, scale=1):
    traces.append(1)
    return batch["ids"] * scale

  ids = np.arange(4, dtype=np.int64)
  ids[2] = BIG
  wrapped = int(np.int64(BIG).astype(np.int32))  # -1294967296: what JAX would have passed on
  with pytest.raises(OverflowError, match=(
      rf"^strategy\.run: the argument at args\[1\]\['ids'\] is int64 and holds {BIG} at index \(2,\), outside the "
      rf"int32 range .* would arrive as {wrapped}\. Enable 64-bit values")):
    strategy.run(fn, args=(np.ones(2, np.float32), {"ids": ids}))
  with pytest.raises(OverflowError, match=rf"^strategy\.run: the argument at kwargs\['scale'\] is int64 and holds {-BIG}"):
    strategy.run(fn, args=(np.ones(2, np.float32), {"ids": np.arange(4)}), kwargs={"scale": np.int64(-BIG)})
  per_replica = tpustrat.PerReplica.from_stacked({"ids": np.full((N, 2), BIG, np.int64)})  # host leaves
  with pytest.raises(OverflowError, match=r"^strategy\.run: the argument at args\[1\]\['ids'\] is int64 .* at index \(0, 0\) "
                                          r"\(16 of its 16 values are out of range\)"):
    strategy.run(fn, args=(np.ones(2, np.float32), per_replica))
  assert not traces  # raised before fn was traced


def test_run_passes_host_int64_arguments_that_fit_exactly(strategy):
  ids = np.array([-2**31, 2**31 - 1, 0, -1], np.int64)
  out = strategy.run(lambda x, y: (x, y + 0), args=(ids, np.uint64(2**32 - 1)))
  np.testing.assert_array_equal(np.asarray(out[0].values[0]), ids.astype(np.int32))
  assert out[0].values[0].dtype == np.int32
  assert int(out[1].values[0]) == 2**32 - 1 and out[1].values[0].dtype == np.uint32


def test_a_failed_step_raises_once_more_at_the_next_wait_saying_so_then_steps_run_again(strategy):
  """A step whose host callback raises: reading its result raises; the next calls dispatch until `run`
  waits for that step (2 in flight), which raises the same error with a note saying that it is an
  earlier step's and that this call's step did not run; the calls after that run (and compute)."""
  def fail(x):
    raise ValueError("the step's own error")

  def step(x):
    bad = jax.lax.cond(x.sum() > 0, lambda: jax.pure_callback(fail, jax.ShapeDtypeStruct((), jnp.float32), x),
                       lambda: jnp.float32(0))
    return x + bad

  with pytest.raises(Exception, match="the step's own error"):
    np.asarray(strategy.run(step, args=(jnp.ones(2),)).values[0])
  outcomes = []
  for i in range(4):
    try:
      out = strategy.run(step, args=(jnp.full(2, -float(i + 1)),))
      outcomes.append(np.asarray(out.values[0]).tolist())
    except Exception as e:  # noqa: BLE001  # the earlier step's error, whatever JAX wraps it in
      assert "the step's own error" in str(e)
      assert any("the step of this call was not dispatched" in note for note in getattr(e, "__notes__", []))
      outcomes.append("raised")
  assert outcomes == [[-1.0, -1.0], "raised", [-3.0, -3.0], [-4.0, -4.0]], outcomes


def test_a_second_call_with_the_same_signature_runs_no_per_signature_work(strategy, monkeypatch, rng):
  """The fast path: a cached program's next call with the same argument structure, shapes and shardings
  neither builds its entry (the structure walk, the per-leaf targets) nor places any argument again."""
  from tpustrat._src.engine import engine as engine_lib
  calls = {"entry": 0, "place": 0, "checked": 0}
  entry, place, checked = engine_lib.Engine._entry, engine_lib.Engine._place, engine_lib.Engine._run_checked

  def counted_checked(self, *a, **k):
    calls["checked"] += 1
    return checked(self, *a, **k)

  def counted_entry(self, *a, **k):
    calls["entry"] += 1
    return entry(self, *a, **k)

  def counted_place(self, *a, **k):
    calls["place"] += 1
    return place(self, *a, **k)

  monkeypatch.setattr(engine_lib.Engine, "_entry", counted_entry)
  monkeypatch.setattr(engine_lib.Engine, "_place", counted_place)
  monkeypatch.setattr(engine_lib.Engine, "_run_checked", counted_checked)
  x = rng.normal(size=(N, 3)).astype(np.float32)
  w0 = rng.normal(size=(3,)).astype(np.float32)

  def step(w, v):
    return w - 0.5 * tpustrat.get_replica_context().all_reduce("mean", v * w)

  xs = stacked(strategy, x)
  w = strategy.run(step, args=(strategy.experimental_mirror(w0), xs))
  assert (calls["entry"], calls["checked"]) == (1, 1)
  calls.update(entry=0, place=0, checked=0)
  w = strategy.run(step, args=(w, xs))
  assert calls == {"entry": 0, "place": 0, "checked": 0}  # not even the argument checks of the checked path
  # The same call with `w` laid out otherwise (on the last device only, not replicated): the checked path
  # places it again, and the numbers are the numpy ones.
  w_one = jax.device_put(jnp.asarray(strategy.experimental_local_results(w)[0]), strategy.mesh.devices.flat[-1])
  w = strategy.run(step, args=(w_one, xs))
  assert calls == {"entry": 1, "place": 1, "checked": 1}  # a plain array, not a Mirrored: another structure
  # A numpy argument is captured on the checked path (a Python float passes on the fast one).
  w = strategy.run(step, args=(np.asarray(strategy.experimental_local_results(w)[0]), xs))
  assert calls["checked"] == 2
  expected = w0.astype(np.float64)
  for _ in range(4):
    expected = expected - 0.5 * (x * expected).mean(axis=0)
  assert_close(np.asarray(strategy.experimental_local_results(w)[0]), expected, rtol=1e-5)


def test_a_result_structure_that_depends_on_shapes_is_right_on_the_fast_path(strategy, rng):
  """One argument structure whose result structure depends on its shapes: calls that take the fast path
  (the same structure and layouts, other shapes: the program traced again inside the call) return the
  structure of their own shapes, in any order, with the numpy values."""
  def fn(v):
    if v.shape[-1] == 2:
      return {"twice": v * 2.0}
    return v + 1.0, v * 3.0

  xs = {width: rng.normal(size=(N, width)).astype(np.float32) for width in (2, 3)}
  given = {width: stacked(strategy, x) for width, x in xs.items()}
  for width in (2, 3, 2, 3, 3, 2):
    out = strategy.run(fn, args=(given[width],))
    x = xs[width].astype(np.float64)
    if width == 2:
      assert isinstance(out, dict) and set(out) == {"twice"}
      assert_close(np.stack(out["twice"].values), x * 2.0, rtol=1e-6)
    else:
      assert isinstance(out, tuple) and len(out) == 2
      assert_close(np.stack(out[0].values), x + 1.0, rtol=1e-6, scale=np.abs(x) + 1.0)
      assert_close(np.stack(out[1].values), x * 3.0, rtol=1e-6)


def test_a_call_that_traced_then_failed_leaves_its_result_structure_known(strategy, rng, monkeypatch):
  """A call of a new signature that traced its program (another result structure) and then failed to
  compile: JAX keeps the trace, so the retry does not trace again; it still returns its own structure, with
  the numpy values, and the first signature's calls theirs."""
  compiler = pytest.importorskip("jax._src.compiler")
  if not hasattr(compiler, "compile_or_get_cached"):
    pytest.skip("jax._src.compiler.compile_or_get_cached is gone: the failure this test injects needs another route")
  real, fail = compiler.compile_or_get_cached, [False]

  def flaky(*args, **kwargs):
    if fail[0]:
      fail[0] = False
      raise RuntimeError("an injected compile failure")
    return real(*args, **kwargs)

  monkeypatch.setattr(compiler, "compile_or_get_cached", flaky)

  def fn(v):
    if v.shape[-1] == 3:
      return {"a": v * 3.0, "b": v + 1.0}
    return v * 2.0, v - 1.0

  xs = {width: rng.normal(size=(N, width)).astype(np.float32) for width in (2, 3)}
  given = {width: stacked(strategy, x) for width, x in xs.items()}
  strategy.run(fn, args=(given[2],))
  strategy.run(fn, args=(given[2],))
  fail[0] = True
  with pytest.raises(RuntimeError, match="an injected compile failure"):
    strategy.run(fn, args=(given[3],))
  for width in (3, 2, 3):
    out = strategy.run(fn, args=(given[width],))
    x = xs[width].astype(np.float64)
    if width == 3:
      assert isinstance(out, dict), jax.tree.structure(out)
      assert_close(np.stack(out["a"].values), x * 3.0, rtol=1e-6)
      assert_close(np.stack(out["b"].values), x + 1.0, rtol=1e-6, scale=np.abs(x) + 1.0)
    else:
      assert isinstance(out, tuple), jax.tree.structure(out)
      assert_close(np.stack(out[0].values), x * 2.0, rtol=1e-6)


def test_a_trace_in_another_thread_does_not_change_a_calls_result_structure(strategy, rng):
  """One thread runs a cached signature on the fast path while another makes the program trace a new one
  whose result structure differs: each call returns its own structure, with the numpy values."""
  import threading  # noqa: PLC0415

  x2, x3 = (rng.normal(size=(N, w)).astype(np.float32) for w in (2, 3))
  g2, g3 = stacked(strategy, x2), stacked(strategy, x3)
  wrong = []
  for _ in range(20):
    def fn(v):  # a new function each round: a new program to trace
      if v.shape[-1] == 3:
        return {"a": v * 3.0}
      return v * 2.0, v - 1.0

    strategy.run(fn, args=(g2,))
    strategy.run(fn, args=(g2,))
    started, stop = threading.Event(), threading.Event()

    def loop(fn=fn, started=started, stop=stop):
      while not stop.is_set():
        out = strategy.run(fn, args=(g2,))
        started.set()
        if not (isinstance(out, tuple) and np.allclose(np.stack(out[0].values), x2 * 2.0)):
          wrong.append(jax.tree.structure(out))

    thread = threading.Thread(target=loop)
    thread.start()
    started.wait()
    try:
      out = strategy.run(fn, args=(g3,))
    finally:
      stop.set()
      thread.join()
    assert isinstance(out, dict) and np.allclose(np.stack(out["a"].values), x3 * 3.0), jax.tree.structure(out)
  assert not wrong, wrong[:3]


def test_a_plain_array_on_the_one_device_is_not_placed_again(monkeypatch, rng):
  """On a one-device strategy a plain `jax.Array` on that device is laid out as the replicated target
  already: `run` passes it as it is (no `jax.device_put` per call), and the result is the numpy one."""
  device = jax.devices()[0]
  one = tpustrat.MirroredStrategy(devices=[device])
  a = rng.normal(size=(4,)).astype(np.float32)
  arr = jax.device_put(a, device)
  fn = lambda v: v * 3.0 + 1.0  # noqa: E731
  one.run(fn, args=(arr,))  # compiled (and the equivalence cached) here
  puts = []
  real_put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda *args, **kw: puts.append(args) or real_put(*args, **kw))
  out = one.run(fn, args=(arr,))
  assert puts == []
  np.testing.assert_allclose(np.asarray(one.experimental_local_results(out)[0]), a * 3.0 + 1.0, rtol=1e-6)


@pytest.mark.parametrize("checked", [False, True])
def test_per_replica_results_fed_back_on_one_device_take_the_fast_path(monkeypatch, rng, checked):
  """On a one-device strategy `run` names its per-replica results split over the replica axis and its
  `Mirrored` ones replicated (XLA alone named some per-replica results `P()`): a per-replica state fed back
  matches what the program wants, so later calls run none of the checked path's work, with numpy's values
  (with `check_numerics` too, whose flags are one more per-replica output)."""
  from tpustrat._src.engine import engine as engine_lib  # noqa: PLC0415
  one = tpustrat.MirroredStrategy(devices=[jax.devices()[0]])
  x = rng.normal(size=(1, 4, 3)).astype(np.float32)
  counts = one.experimental_distribute_values_from_function(lambda ctx: np.zeros((), np.int32))
  state = {"x": one.experimental_distribute_values_from_function(lambda ctx: x[0]), "n": counts}
  w = one.experimental_mirror(np.float32(2.0))
  options = tpustrat.RunOptions(check_numerics=True) if checked else None

  def step(state, w):
    total = tpustrat.get_replica_context().all_reduce("sum", state["x"].sum())
    return {"x": state["x"] * 0.5 + w, "n": state["n"] + 1}, w + total * 0.0 + 1.0

  state, w = one.run(step, args=(state, w), options=options)
  split, replicated = jax.sharding.PartitionSpec("replica"), jax.sharding.PartitionSpec()
  assert state["x"].tree.sharding.spec == split and state["n"].tree.sharding.spec == split
  assert w.tree.sharding.spec == replicated
  calls = []
  real = engine_lib.Engine._run_checked
  monkeypatch.setattr(engine_lib.Engine, "_run_checked", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
  for _ in range(3):
    state, w = one.run(step, args=(state, w), options=options)
  one.experimental_run_wait()
  assert calls == []
  want, wv = x.astype(np.float64), 2.0
  for _ in range(4):
    want, wv = want * 0.5 + wv, wv + 1.0
  assert_close(np.stack(one.experimental_local_results(state["x"])), want, rtol=1e-6)
  assert int(np.asarray(one.experimental_local_results(state["n"])[0])) == 4
  assert float(np.asarray(one.experimental_local_results(w)[0])) == wv


def test_a_plain_array_and_the_replicated_result_share_one_compiled_program(rng):
  """On a one-device strategy a plain array on that device and `run`'s replicated result are the same
  layout under two names: `run` renames the first (no copy, no `jax.device_put`) so that both calls run
  one program, traced and compiled once (passed as it was, it compiled the step once more: a Keras model's
  second `fit`). The values are numpy's."""
  device = jax.devices()[0]
  one = tpustrat.MirroredStrategy(devices=[device])
  traces = []

  def fn(v):
    traces.append(1)
    return v * 2.0 + 1.0

  a = rng.normal(size=(3,)).astype(np.float32)
  plain = jnp.asarray(a)  # uncommitted, on the default device (as Keras makes its optimizer's scalars)

  def calls():
    out = one.run(fn, args=(plain,))  # a plain array: renamed
    out = one.run(fn, args=(out,))  # the Mirrored result
    return one.run(fn, args=(plain,))

  out, compiles = backend_compiles(calls)
  assert len(traces) == 1 and compiles == 1
  assert plain.sharding == jax.sharding.SingleDeviceSharding(device)  # the caller's array is untouched
  np.testing.assert_allclose(np.asarray(one.experimental_local_results(out)[0]), a * 2.0 + 1.0, rtol=1e-6)


def test_a_donated_plain_array_passed_again_is_named_before_it_is_placed(strategy, rng):
  """A plain `jax.Array` committed to one device, given whole (so `run` places it on every device) and
  donated: its placed copy holds the caller's own buffer on that device (`jax.device_put` moves nothing
  there), so donating the copy donates the caller's array, as donating it to `jax.jit` would. Passed again,
  `run` names the argument and says why, before placing it (the transfer raised JAX's "Array has been
  deleted" before). The donating call's values are numpy's."""
  a = rng.normal(size=(N,)).astype(np.float32)
  table = jax.device_put(a, jax.devices()[0])
  xs = rng.normal(size=(N, N)).astype(np.float32)
  x = stacked(strategy, xs)
  donate = tpustrat.RunOptions(donate_argnums=(0,))
  out = strategy.run(lambda t, v: (t * 2.0, t * v), args=(table, x), options=donate)
  np.testing.assert_allclose(np.asarray(strategy.experimental_local_results(out[0])[0]), a * 2.0, rtol=1e-6)
  np.testing.assert_allclose(np.stack([np.asarray(c) for c in strategy.experimental_local_results(out[1])]),
                             a * xs, rtol=1e-6)
  deleted = table.is_deleted()
  assert deleted
  with pytest.raises(RuntimeError, match=r"args\[0\] has been deleted: it was donated"):
    strategy.run(lambda t, v: t * v, args=(table, x))


def test_run_options_equality_hash_and_pickle():
  """`RunOptions` compares and hashes by its fields (made once, for `run`'s fast path, which looks calls up
  by their options), tells ``scan_unroll=True`` from ``1``, and survives pickling: loaded, it is made again
  from its fields (equal, the same hash, found in a dict), and a pickle of the plain dataclass (its fields
  as a dict, as the library before wrote it) loads into options equal to the ones made directly."""
  import dataclasses
  import pickle

  made = tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=3, donate_argnums=(1, 0))
  assert made == tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=3, donate_argnums=(0, 1))
  assert made != tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=2, donate_argnums=(0, 1))
  assert tpustrat.RunOptions(scan_unroll=True) != tpustrat.RunOptions(scan_unroll=1)
  loaded = pickle.loads(pickle.dumps(made))
  assert loaded == made and hash(loaded) == hash(made) and {made: "found"}.get(loaded) == "found"
  assert loaded.donate_argnums == (0, 1) and loaded.max_steps_in_flight == 3
  plain = object.__new__(tpustrat.RunOptions)
  plain.__setstate__({f.name: getattr(made, f.name) for f in dataclasses.fields(made)})
  assert plain == made and hash(plain) == hash(made)

  @dataclasses.dataclass(frozen=True, eq=False)
  class Sub(tpustrat.RunOptions):
    pass

  assert Sub(max_steps_in_flight=2) == Sub(max_steps_in_flight=2) != tpustrat.RunOptions(max_steps_in_flight=2)
  with pytest.raises(TypeError, match="unhashable"):
    hash(tpustrat.RunOptions(experimental_xla_options={"a": 1}))


def test_one_array_given_twice_one_place_donated_is_refused_before_it_is_placed(strategy, rng):
  """The same plain array, committed to one device, at two argument positions, one donated: `run` places
  each (their copies share the array's buffer on its device, so XLA would be handed one buffer donated and
  read in one call: XLA:CPU crashed the process) and refuses, naming both positions, as for an array
  already placed given twice."""
  t = jax.device_put(rng.normal(size=(N,)).astype(np.float32), jax.devices()[1])
  x = stacked(strategy, rng.normal(size=(N, N)).astype(np.float32))
  with pytest.raises(ValueError, match=r"args\[1\] is the same array as the argument at args\[0\], which is donated"):
    strategy.run(lambda a, b, v: (a * 2.0, b * v), args=(t, t, x), options=tpustrat.RunOptions(donate_argnums=(0,)))
  deleted = t.is_deleted()
  assert not deleted
