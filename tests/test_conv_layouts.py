"""Convolutions in compiled loops on XLA:CPU (`tpustrat._src.conv_layouts`).

XLA:CPU lays a convolution out for its fast kernel only in a program's entry computation; tpustrat does it
before the loops it builds (`experimental_run_steps`, `accumulate_gradients`). Each test checks two things:
the values (numpy on the same inputs, or JAX on one device without the rewrite), and that the compiled
program's convolutions all have the canonical dimension numbers (``b01f_01io->b01f``), which they did not
inside a loop before (a weight gradient is ``f01b_i01o->01bf``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax import lax

import tpustrat
from tpustrat._src import conv_layouts, jax_compat, multistep

CANONICAL = "dim_labels=b01f_01io->b01f"


def np_conv(x, w, strides=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1):
  """A 2-D convolution in numpy (float64): `x` NHWC, `w` HWIO, explicit padding, kernel dilation, groups."""
  x = np.pad(np.asarray(x, np.float64), ((0, 0), *padding, (0, 0)))
  w = np.asarray(w, np.float64)
  kh, kw, cin_g, cout = w.shape
  n, height, width, _ = x.shape
  oh = (height - (kh - 1) * dilation[0] - 1) // strides[0] + 1
  ow = (width - (kw - 1) * dilation[1] - 1) // strides[1] + 1
  out = np.zeros((n, oh, ow, cout))
  cout_g = cout // groups
  for g in range(groups):
    for i in range(kh):
      for j in range(kw):
        r0, c0 = i * dilation[0], j * dilation[1]
        patch = x[:, r0:r0 + strides[0] * (oh - 1) + 1:strides[0], c0:c0 + strides[1] * (ow - 1) + 1:strides[1],
                  g * cin_g:(g + 1) * cin_g]
        out[..., g * cout_g:(g + 1) * cout_g] += np.einsum("nhwc,co->nhwo", patch,
                                                           w[i, j, :, g * cout_g:(g + 1) * cout_g])
  return out


def conv_equations(jaxpr):
  """Every convolution equation of `jaxpr`, at any depth."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is lax.conv_general_dilated_p:
      found.append(eqn)
    for sub in jax_compat.sub_jaxprs(eqn):
      found += conv_equations(sub)
  return found


def is_canonical(eqn):
  lhs, rhs, out = (tuple(s) for s in eqn.params["dimension_numbers"])
  rank = len(lhs)
  spatial = tuple(range(1, rank - 1))
  return lhs == out == (0, rank - 1, *spatial) and rhs == (rank - 1, rank - 2, *range(rank - 2))


def conv_labels(hlo):
  return re.findall(r"dim_labels=\S+?(?=[,\s])", hlo)


def rng_arrays(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=s).astype(np.float32) for s in shapes]


def nested(x_nchw, w_oihw, ws):
  """NCHW / OIHW convolutions in a scan, a cond, a jit, a checkpoint, and a weight gradient."""
  conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))

  def body(c, x):
    return c + 1.0, lax.cond(c > 0.5, lambda: conv(x, w_oihw), lambda: -conv(x, w_oihw))

  _, scanned = lax.scan(body, jnp.float32(0.0), x_nchw)
  jitted = jax.jit(conv)(x_nchw[0], w_oihw)
  remat = jax.checkpoint(conv)(x_nchw[1], w_oihw)
  grad = jax.grad(lambda w: jnp.sum(lax.conv_general_dilated(
      x_nchw[0], w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")) * ws))(w_oihw)
  return scanned, jitted, remat, grad


def test_convolutions_at_any_depth_are_canonical_and_equal_numpy():
  x, w, ws = rng_arrays(0, (2, 3, 2, 7, 6), (4, 2, 3, 2), (3, 4, 5, 5))
  before = conv_equations(jax.make_jaxpr(nested)(x, w, ws).jaxpr)
  rewritten = jax.make_jaxpr(conv_layouts.canonical_convolutions(nested))(x, w, ws)
  after = conv_equations(rewritten.jaxpr)
  assert len(after) == len(before) >= 5 and not all(map(is_canonical, before))
  assert all(map(is_canonical, after))
  scanned, jitted, remat, grad = jax.jit(conv_layouts.canonical_convolutions(nested))(x, w, ws)
  nhwc = lambda a: np.moveaxis(a, 1, -1)
  hwio = np.transpose(w, (2, 3, 1, 0))
  want = [np.moveaxis(np_conv(nhwc(x[i]), hwio), -1, 1) for i in range(2)]
  assert_close(scanned[0], -want[0])  # the first step's counter is 0: the cond's other branch
  assert_close(scanned[1], want[1])
  assert_close(jitted, want[0])
  assert_close(remat, want[1])
  # d/dw sum(conv(x, w) * ws): sum over n, h, w of x patches times ws
  xs = nhwc(x[0]).astype(np.float64)
  ws_nhwc = nhwc(ws).astype(np.float64)
  want_grad = np.zeros((3, 2, 2, 4))  # HWIO
  for i in range(3):
    for j in range(2):
      want_grad[i, j] = np.einsum("nhwc,nhwo->co", xs[:, i:i + 5, j:j + 5, :], ws_nhwc)
  assert_close(grad, np.transpose(want_grad, (3, 2, 0, 1)))


@pytest.mark.parametrize("case", ["strides_padding_dilation", "groups", "depthwise", "nchw_1d", "ncdhw_3d"])
def test_each_kind_of_convolution_keeps_its_values(case):
  """The rewrite only permutes dimensions: strides, padding, dilations and groups are per spatial dimension
  or per feature, and keep their meaning; forward values and gradients equal the unrewritten JAX program (and
  numpy for the 2-D forward)."""
  if case == "nchw_1d":
    x, w = rng_arrays(1, (3, 4, 9), (5, 4, 3))
    kw = dict(window_strides=(2,), padding=((1, 2),), dimension_numbers=("NCH", "OIH", "NCH"))
  elif case == "ncdhw_3d":
    x, w = rng_arrays(2, (2, 2, 5, 4, 6), (3, 2, 2, 2, 3))
    kw = dict(window_strides=(1, 1, 2), padding="SAME", dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))
  else:
    groups = {"strides_padding_dilation": 1, "groups": 2, "depthwise": 4}[case]
    x, w = rng_arrays(3, (2, 9, 8, 4), (3, 2, 4 // groups, 8))
    kw = dict(window_strides=(2, 1), padding=((1, 0), (2, 1)), rhs_dilation=(1, 2), feature_group_count=groups,
              dimension_numbers=("NHWC", "HWIO", "NHWC"))
  conv = lambda x, w: lax.conv_general_dilated(x, w, **kw)
  loss = lambda x, w: jnp.sum(jnp.sin(conv(x, w)))

  def f(x, w):
    return lax.scan(lambda c, _: (c, (conv(x, w), *jax.grad(loss, argnums=(0, 1))(x, w))), 0.0, None, length=2)[1]

  got = jax.jit(conv_layouts.canonical_convolutions(f))(x, w)
  assert all(map(is_canonical, conv_equations(jax.make_jaxpr(conv_layouts.canonical_convolutions(f))(x, w).jaxpr)))
  want = jax.jit(f)(x, w)  # plain JAX, no rewrite
  for g, e in zip(got, want):
    assert_close(g, e, rtol=1e-4)
  if case != "nchw_1d" and case != "ncdhw_3d":
    assert_close(got[0][0], np_conv(x, w, (2, 1), ((1, 0), (2, 1)), (1, 2), kw["feature_group_count"]), rtol=1e-4)


def test_a_program_without_convolutions_is_left_as_it_is():
  closed = jax.make_jaxpr(lambda x: lax.scan(lambda c, y: (c + y, c * y), 0.0, x))(jnp.arange(4.0))
  assert jax_compat.rewrite_equations(closed, conv_layouts._canonical) is closed  # noqa: SLF001
  x, w = rng_arrays(4, (1, 5, 5, 2), (3, 3, 2, 3))
  canonical = jax.make_jaxpr(lambda x, w: lax.conv_general_dilated(
      x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")))(x, w)
  assert jax_compat.rewrite_equations(canonical, conv_layouts._canonical) is canonical  # noqa: SLF001


def test_only_a_cpu_is_rewritten_for():
  class Device:
    def __init__(self, platform):
      self.platform = platform

  assert conv_layouts.on_cpu(np.array([Device("cpu")] * 2))
  assert not conv_layouts.on_cpu(np.array([Device("gpu")] * 2)) and not conv_layouts.on_cpu([Device("tpu")])
  assert conv_layouts.on_cpu(None) == (jax.default_backend() == "cpu")


# -- the loops tpustrat builds ------------------------------------------------------------------------------

GLOBAL = 16


def init_params():
  w1, w2, d = rng_arrays(5, (3, 3, 1, 4), (3, 3, 4, 6), (6, 3))
  return {"w1": w1 * 0.5, "w2": w2 * 0.3, "d": d * 0.3}


def per_example_loss(params, x, y):
  conv = lambda x, w, s: lax.conv_general_dilated(x, w, (s, s), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = jax.nn.relu(conv(x, params["w1"], 1))
  h = jax.nn.relu(conv(h, params["w2"], 2)).mean((1, 2))
  logits = h @ params["d"]
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]


def batches(n):
  rng = np.random.default_rng(6)
  return [(rng.normal(size=(GLOBAL, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, GLOBAL).astype(np.int32))
          for _ in range(n)]


def one_device_sgd(params, data):
  """Plain JAX on one device: the mean loss over each global batch, SGD."""
  @jax.jit
  def step(p, x, y):
    g = jax.grad(lambda p: per_example_loss(p, x, y).mean())(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

  for x, y in data:
    params = step(params, x, y)
  return params


def replica_step(params, batch):
  # The gradient w.r.t. Mirrored parameters is already summed over the replicas (JAX's shard_map).
  x, y = batch
  g = jax.grad(lambda p: tpustrat.compute_average_loss(per_example_loss(p, x, y), global_batch_size=GLOBAL))(params)
  return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), None


@pytest.mark.parametrize("replicas", [1, 8])
def test_run_steps_of_a_convnet_compile_canonical_convolutions_in_the_loop_and_equal_one_device(replicas):
  strategy = tpustrat.MirroredStrategy(jax.devices()[:replicas])
  data = batches(6)
  stacked = iter(strategy.experimental_distribute_dataset(data)).take_steps(3)
  carry = strategy.experimental_mirror(jax.tree.map(jnp.asarray, init_params()))
  hlo = multistep._program(strategy, replica_step).lower(carry, stacked).compile().as_text()  # noqa: SLF001
  labels = conv_labels(hlo)
  assert "while" in hlo and len(labels) >= 5 and set(labels) == {CANONICAL}, sorted(set(labels))
  it = iter(strategy.experimental_distribute_dataset(data))
  state = carry
  for _ in range(2):
    state, _ = strategy.experimental_run_steps(replica_step, it, 3, init=state)
  want = one_device_sgd(init_params(), data)
  for name in want:
    assert_close(state[name].values[0], want[name], rtol=1e-4)


def test_accumulated_gradients_of_a_convnet_compile_canonical_convolutions_and_equal_one_device():
  strategy = tpustrat.TPUStrategy()
  (x, y), = batches(1)
  params = jax.tree.map(jnp.asarray, init_params())

  def step(params, batch):
    xb, yb = batch
    loss_fn = lambda p, mb: tpustrat.compute_average_loss(per_example_loss(p, *mb), global_batch_size=GLOBAL)
    loss, grads = tpustrat.accumulate_gradients(loss_fn, params, (xb, yb), gradient_accumulation_steps=2)
    return loss, grads

  batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
  mirrored = strategy.experimental_mirror(params)
  hlo = jax.jit(lambda p, b: strategy.run(step, args=(p, b))).lower(mirrored, batch).compile().as_text()
  labels = conv_labels(hlo)
  assert "while" in hlo and len(labels) >= 5 and set(labels) == {CANONICAL}, sorted(set(labels))
  loss, grads = strategy.run(step, args=(mirrored, batch))
  want_loss, want_grads = jax.value_and_grad(lambda p: per_example_loss(p, x, y).mean())(params)
  assert_close(strategy.reduce("sum", loss, axis=None), want_loss, rtol=1e-4)
  for name in want_grads:
    assert_close(grads[name].values[0], want_grads[name], rtol=1e-4)
