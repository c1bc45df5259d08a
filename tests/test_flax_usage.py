"""Plain Flax/optax/orbax code around ``CPAttention`` on the mesh ``jax_cp.make_mesh`` gives by default.

Each test is the first hour of a user: a small NNX language model (``nnx.Embed`` ->
attention blocks -> logits, optax integer-label cross entropy) trained and restored with orbax, a
Linen model initialised under ``jax.set_mesh``, eager ``jax.grad`` and slicing of
``dot_product_attention`` outputs. Values are checked against a single-device reference.
Explicit meshes stay supported; the last tests are the recipe the README gives for them.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from conftest import needs_devices
from util import assert_close

V, D, H, B, S = 64, 32, 2, 2, 16  # vocabulary, model width, heads, batch, sequence
CUT = dict(cp_colossal=2, cp_ulysses=2)  # dp takes the other 2 of the 8 devices
ACT = P("dp", ("cp_colossal", "cp_ulysses"), None)
STEPS = 3


def tokens():
    tok = jax.random.randint(jax.random.key(1), (B, S + 1), 0, V)
    return tok[:, :-1], tok[:, 1:]


class Block(nnx.Module):
    def __init__(self, *, mesh, rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        if mesh is None:
            self.attn = jax_cp.reference.Attention(num_heads=H, in_features=D, is_causal=True, rngs=rngs)
        else:
            self.attn = jax_cp.CPAttention(num_heads=H, in_features=D, mesh=mesh, is_causal=True, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(jax.nn.gelu(x))


class LM(nnx.Module):
    """``mesh=None`` builds the single-device twin (reference attention, the same parameters)."""

    def __init__(self, *, mesh, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(mesh=mesh, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tok):
        x = self.embed(tok)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(model, x, y, steps=STEPS):
    """Ordinary NNX + optax training, nothing mesh-specific."""
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    return np.array([float(step(model, opt, x, y)) for _ in range(steps)])


@pytest.fixture(scope="module")
def reference_losses():
    return train(LM(mesh=None, rngs=nnx.Rngs(0)), *tokens())


def test_default_mesh_is_auto():
    mesh = jax_cp.make_mesh(**CUT)
    assert set(mesh.axis_types) == {AxisType.Auto}, mesh.axis_types
    with pytest.raises(ValueError, match="axis_types=None"):
        jax_cp.make_mesh(axis_types=None)


@needs_devices(8)
@pytest.mark.parametrize("shard_batch", [False, True], ids=["plain-batch", "dp-sharded-batch"])
def test_nnx_embed_optax_trains_on_default_mesh(shard_batch, reference_losses):
    """Item 1: died in the first backward (optax scatter; nnx.Embed gather with a sharded batch)."""
    mesh = jax_cp.make_mesh(**CUT)
    x, y = tokens()
    if shard_batch:
        x, y = (jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in (x, y))
    losses = train(LM(mesh=mesh, rngs=nnx.Rngs(0)), x, y)
    assert losses[-1] < losses[0], losses
    assert_close(losses, reference_losses, jnp.float32, "CP losses vs the single-device model")


@needs_devices(8)
def test_orbax_restore_from_eval_shape_is_exact(tmp_path):
    """Item 3: flax's recipe (restore into ``nnx.eval_shape`` targets) failed deep in orbax."""
    mesh = jax_cp.make_mesh(**CUT)
    model = LM(mesh=mesh, rngs=nnx.Rngs(0))
    train(model, *tokens(), steps=1)
    state = nnx.state(model)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        abstract = nnx.eval_shape(lambda: LM(mesh=mesh, rngs=nnx.Rngs(1)))
        graphdef, target = nnx.split(abstract)
        restored = nnx.merge(graphdef, ckpt.restore(tmp_path / "ckpt", target))
    for (path, want), (_, got) in zip(nnx.to_flat_state(state), nnx.to_flat_state(nnx.state(restored))):
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), err_msg=str(path))
        assert got[...].sharding.is_equivalent_to(want[...].sharding, want[...].ndim), path
    x, _ = tokens()
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m: m(x))(restored)),
                                  np.asarray(nnx.jit(lambda m: m(x))(model)))


class LinenLM(nn.Module):
    mesh: object

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(V, D)(tok)
        for _ in range(2):
            x = x + jax_cp.linen.CPAttention(num_heads=H, in_features=D, mesh=self.mesh, is_causal=True)(
                nn.RMSNorm()(x))
            x = x + nn.Dense(D)(jax.nn.gelu(x))
        return nn.Dense(V)(x)


def train_linen(model, params, x, y, steps=STEPS):
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return np.array(losses)


@needs_devices(8)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_linen_init_under_set_mesh(axis_type):
    """Item 2: every form of init under ``jax.set_mesh`` tripped flax's sharding assert on Explicit meshes."""
    mesh = jax_cp.make_mesh(**CUT, axis_types=axis_type)
    layer = jax_cp.linen.CPAttention(num_heads=H, in_features=D, mesh=mesh, is_causal=True)
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    with jax.set_mesh(mesh):
        eager = layer.init(jax.random.key(0), x)
        jitted = jax.jit(layer.init)(jax.random.key(0), x)
    plain = layer.init(jax.random.key(0), x)  # no mesh in context
    for variables in (jitted, plain):
        jax.tree.map(np.testing.assert_array_equal, nn.unbox(variables), nn.unbox(eager))
    assert nn.get_partition_spec(eager)["params"]["q_kernel"] == P(None, "tp", None)


@needs_devices(8)
def test_linen_model_trains_on_default_mesh():
    """A Linen LM (nn.Embed, CPAttention blocks, optax loss) on the default mesh, initialised under
    ``jax.set_mesh``, trains as the same model on one device."""
    x, y = tokens()
    runs = []
    for mesh in (jax_cp.make_mesh(**CUT), jax_cp.make_mesh(devices=jax.devices()[:1])):
        model = LinenLM(mesh=mesh)
        with jax.set_mesh(mesh):
            params = jax.jit(model.init)(jax.random.key(0), x)
            runs.append(train_linen(model, params, x, y))
    losses, single_device = runs
    assert losses[-1] < losses[0], losses
    assert_close(losses, single_device, jnp.float32, "8-device vs 1-device Linen losses")


@needs_devices(8)
def test_eager_grad_and_slicing_like_jax_nn():
    """Item 4: outside jit and ``jax.set_mesh``, outputs behave as ``jax.nn.dot_product_attention``'s."""
    mesh = jax_cp.make_mesh(**CUT)
    q = jax.random.normal(jax.random.key(0), (B, S, 4, 8))
    seg = jnp.asarray(np.repeat([0, 1], [10, S - 10]))[None].repeat(B, 0)
    cp = lambda q: jax_cp.dot_product_attention(q, q, q, mesh=mesh, is_causal=True, segment_ids=seg)
    ref = lambda q: jax_cp.reference.dot_product_attention(q, q, q, is_causal=True, segment_ids=seg)

    assert_close(jax.grad(lambda q: jnp.sum(cp(q)))(q), jax.grad(lambda q: jnp.sum(ref(q)))(q), jnp.float32)
    assert_close(jax.grad(lambda q: cp(q)[0].sum())(q), jax.grad(lambda q: ref(q)[0].sum())(q), jnp.float32)
    out, want = cp(q), ref(q)
    assert_close(out[:, -1], want[:, -1], jnp.float32)
    assert_close(out[:, :14], want[:, :14], jnp.float32)
    assert_close(jax.jit(lambda o, i: o[:, i])(out, 3), want[:, 3], jnp.float32)


def test_eager_calls_run_one_compiled_program_per_layer():
    """Outside ``jit`` (a plain call, Linen's ``init``, ``jax.grad`` of concrete values) the sharded
    body runs as one jitted program, cached per layer, not primitive by primitive; under ``jit``
    it is inlined (no cached program is added)."""
    from jax_cp._body import _EAGER_PROGRAMS

    mesh = jax_cp.make_mesh(**CUT)
    q = jax.random.normal(jax.random.key(3), (B, 32, 4, 8))
    f = lambda q: jax_cp.dot_product_attention(q, q, q, mesh=mesh, is_causal=True, scale=0.3)
    before = len(_EAGER_PROGRAMS)
    eager = f(q)
    assert len(_EAGER_PROGRAMS) == before + 1
    assert_close(f(q * 1.0), eager, jnp.float32)  # same layer, same program
    assert len(_EAGER_PROGRAMS) == before + 1
    jitted = jax.jit(f)(q)
    assert len(_EAGER_PROGRAMS) == before + 1
    assert_close(eager, jitted, jnp.float32)
    g = jax.grad(lambda q: f(q).sum())(q)  # grad of concrete values: the forward program is jitted too
    assert_close(g, jax.jit(jax.grad(lambda q: f(q).sum()))(q), jnp.float32)
    model = jax_cp.linen.CPAttention(4, 16, mesh=mesh, is_causal=True)
    model.init(jax.random.key(0), jnp.ones((B, 32, 16)))  # eager init: one program for the layer
    assert len(_EAGER_PROGRAMS) == before + 2  # (the grad reused the forward's program)


# ---- Explicit meshes: supported, with the recipe the README gives ---------------------------------


class ExplicitLM(LM):
    """On an Explicit mesh, a gather with sharded indices names its output sharding."""

    def __call__(self, tok):
        x = self.embed.embedding[...].at[tok].get(out_sharding=ACT)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@needs_devices(8)
def test_explicit_mesh_recipe_trains_and_restores(tmp_path, reference_losses):
    mesh = jax_cp.make_mesh(**CUT, axis_types=AxisType.Explicit)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: ExplicitLM(mesh=mesh, rngs=nnx.Rngs(0)))()
        x, y = (jax.reshard(a, P("dp", ("cp_colossal", "cp_ulysses"))) for a in tokens())
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x, y):  # one-hot labels: no scatter in the backward
            loss_fn = lambda m: optax.softmax_cross_entropy(m(x), jax.nn.one_hot(y, V)).mean()
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss

        losses = np.array([float(step(model, opt, x, y)) for _ in range(STEPS)])
    assert_close(losses, reference_losses, jnp.float32, "Explicit-mesh losses vs the single-device model")

    # Orbax on Explicit meshes: restore into concrete NamedSharding targets (eval_shape's carry an
    # AbstractMesh, which orbax cannot place).
    state = nnx.state(model)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt", target)
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), np.asarray(want)), restored, state)
