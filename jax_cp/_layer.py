"""One context-parallel attention layer as a pure function of its parameters.

Shared by the NNX and Linen modules: parameter shapes, their sharding
(``AttentionSharding``, the storage layout; computed in the tp layout) and
``layer_forward``, which runs ``_body.attention_shard`` with the layer's
``LinearProjections`` inside one ``jax.shard_map``.
Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cp._body import attention_shard, check_dtype, kernel_for_dtype, metadata_sides, placed_metadata, shard_call
from jax_cp._defaults import AUTO
from jax_cp._mesh import CP, DP, TP, after, gather, gather_dims, mesh_dims, place, unshard
from jax_cp._meta import Meta
from jax_cp._params import init_param, param_shapes
from jax_cp._projection import LinearProjections
from jax_cp._spec import AttentionSpec, Layout, check_seq_batch

__all__ = ["AttentionSharding", "LayerCall", "compute_specs", "init_param", "kv_inputs", "layer_call", "layer_forward",
           "gather_stored", "param_shapes", "param_specs", "storage_specs"]

X_SPEC = P(DP, CP, None)
SPLIT_X_SPEC = P(DP, CP, TP)  # split_over_tp: the features split over tp (the residual stream of a tp model)
PARAMS = ("q_kernel", "k_kernel", "v_kernel", "o_kernel", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm",
          "sinks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSharding:
    """Where ``CPAttention`` stores each parameter: one ``PartitionSpec`` per parameter name.

    ``None`` fields take the compute layout (q/k/v kernels split over ``tp`` by
    heads, the output kernel by rows). Any storage layout works: each call puts
    the weights in the compute layout first (e.g. an FSDP all-gather over
    ``dp``). ``param_specs(spec, mesh)`` gives the compute layout to start from.

    Attributes:
        q_kernel, k_kernel, v_kernel, o_kernel: the projection kernels' storage specs.
        q_bias, k_bias, v_bias, o_bias: the biases' (``use_bias``).
        q_norm, k_norm: the QK-norm scales' (``use_qk_norm``).
        sinks: the sink logits' (``use_sinks``).
    """

    q_kernel: P | None = None
    k_kernel: P | None = None
    v_kernel: P | None = None
    o_kernel: P | None = None
    q_bias: P | None = None
    k_bias: P | None = None
    v_bias: P | None = None
    o_bias: P | None = None
    q_norm: P | None = None
    k_norm: P | None = None
    sinks: P | None = None

    def resolve(self, compute: dict[str, P]) -> dict[str, P]:
        """Storage specs of the parameters in ``compute`` (their compute specs)."""
        return {name: getattr(self, name) or spec for name, spec in compute.items()}


def _compute_specs(spec: AttentionSpec, layout: Layout) -> dict[str, P]:
    kv = P(None, TP, None) if layout.kv_sharded else P(None, None, None)
    specs = {"q_kernel": P(None, TP, None), "k_kernel": kv, "v_kernel": kv, "o_kernel": P(TP, None, None)}
    if spec.use_bias:
        kvb = P(TP, None) if layout.kv_sharded else P(None, None)
        specs |= {"q_bias": P(TP, None), "k_bias": kvb, "v_bias": kvb, "o_bias": P(None)}
    if spec.use_qk_norm:
        specs |= {"q_norm": P(None), "k_norm": P(None)}
    if spec.use_sinks:
        specs |= {"sinks": P(TP)}  # with the query heads
    return specs


def param_specs(spec: AttentionSpec, mesh) -> AttentionSharding:
    """The compute layout of the layer's parameters on ``mesh`` (the default storage layout).

    Args:
        spec: the layer's :class:`AttentionSpec`.
        mesh: the mesh.

    Returns:
        An :class:`AttentionSharding` with every parameter of ``spec`` set.
    """
    return AttentionSharding(**_compute_specs(spec, spec.layout(mesh_dims(mesh))))


def storage_specs(spec: AttentionSpec, mesh, sharding: AttentionSharding | None = None) -> dict[str, P]:
    """Each parameter's storage spec: ``sharding``'s where it sets one, else the compute layout."""
    return (sharding or AttentionSharding()).resolve(_compute_specs(spec, spec.layout(mesh_dims(mesh))))


FIRST_GATHERED = ("k_kernel", "v_kernel")  # FSDP without Ulysses: gathered before the layer's other weights


def _unshard_params(params: dict, stored: tuple, dtype, staged: bool) -> dict:
    """Inside the layer's ``shard_map``: the parameters ``stored`` names (``(name, storage spec, compute spec)``)
    all-gathered from their storage blocks (``_mesh.unshard``; kernels cast to ``dtype`` first), so each
    one's gradient is a reduce-scatter of this device's partial sum.

    ``staged``: the K and V kernels first, the others once those have arrived (``_mesh.after``). Left
    independent, XLA combines every gather of the layer into one collective that the first projection
    waits for whole (80 MiB a layer on a TPU7x pod, tp = 1); staged, the K/V projection waits for 16 MiB
    and the Q and O kernels' gather can run under it (docs/guides/maxtext.md, "Ironwood")."""
    layouts = {name: (st, sp) for name, st, sp in stored}
    gather_ = lambda k, v: unshard(v, *layouts[k], dtype if k.endswith("_kernel") else None)  # noqa: E731
    out = dict(params)
    first = [k for k in FIRST_GATHERED if staged and k in layouts and k in params]
    for k in first:
        out[k] = gather_(k, params[k])
    dep = tuple(out[k] for k in first)
    for k in layouts:
        if k not in first and k in params:
            out[k] = gather_(k, after(params[k], dep) if dep else params[k])
    return out


def _layer_shard(params, x_BSD, *args, spec: AttentionSpec, layout: Layout, dtype, stored: tuple = (),
                 split: bool = False):
    *kv_x, meta = args  # cross attention's K/V inputs, then the metadata
    # Staged where no Ulysses all-to-all wants Q first: the colossal exchanges start from K/V.
    params = _unshard_params(params, stored, dtype, staged=layout.dims.u == 1 and not kv_x)
    projections = LinearProjections.build(params, x_BSD, meta.pos, spec=spec, layout=layout, dtype=dtype,
                                          kv_x=tuple(kv_x), kv_pos_BS=meta.kv_pos, split=split)
    return attention_shard(projections, meta, spec=spec)


def _check_input(name: str, x, in_features: int, batch: int | None = None):
    if getattr(x, "ndim", None) != 3 or x.shape[-1] != in_features or batch not in (None, x.shape[0]):
        b = "batch" if batch is None else f"batch={batch}"
        raise ValueError(f"{name}.shape={getattr(x, 'shape', None)} must be ({b}, seq_len, "
                         f"in_features={in_features}).")
    check_dtype(name, x.dtype)


def kv_inputs(x_BSD, inputs_k=None, inputs_v=None, inputs_kv=None) -> tuple:
    """The inputs K and V are projected from, when they are not ``x`` (flax's ``inputs_k``/``inputs_v``,
    each defaulting to the one before; ``inputs_kv``: one input for both): ``()`` for
    self-attention, ``(x_kv,)`` when K and V share one input, ``(x_k, x_v)`` otherwise."""
    if inputs_kv is not None:
        if inputs_k is not None or inputs_v is not None:
            raise ValueError("inputs_kv= is one input for keys and values; pass it or inputs_k/inputs_v, not both.")
        inputs_k = inputs_kv
    k = x_BSD if inputs_k is None else inputs_k
    v = k if inputs_v is None else inputs_v
    if k is x_BSD and v is x_BSD:
        return ()
    return (k,) if v is k else (k, v)


def _cross_changes(spec: AttentionSpec, cross: bool) -> dict:
    """Cross attention's K/V are other tokens than Q, so they never share Q's all-to-all."""
    if not cross or spec.fused_qkv_chunks == 0:
        return {}
    if spec.fused_qkv_chunks != AUTO:
        raise ValueError(f"fused_qkv_chunks={spec.fused_qkv_chunks} sends Q, K and V of the same tokens in one "
                         "all-to-all, but cross attention projects K and V from other inputs; use "
                         "fused_qkv_chunks=0 (or 'auto').")
    return {"fused_qkv_chunks": 0}


@dataclasses.dataclass
class LayerCall:
    """One call of the layer, prepared: the resolved spec and layout, the ``shard_map`` arguments
    (parameters, inputs, metadata) with their in_specs, the output specs and ``_layer_shard``'s settings;
    ``meta`` is the placed metadata (the last argument)."""

    mesh: object
    spec: AttentionSpec
    layout: Layout
    batch: int
    seq_len: int
    args: list
    in_specs: list
    out_specs: object
    kwargs: dict

    @property
    def meta(self) -> Meta:
        return self.args[-1]


def layer_call(params: dict, x_BSD, *, mesh, spec: AttentionSpec, dtype=None, positions=None, segment_ids=None,
               local_window_size=None, scale=None, kv_x: tuple = (), kv_positions=None,
               kv_segment_ids=None, span_ids=None, kv_span_ids=None, stored: dict | None = None,
               split_over_tp: bool = False) -> LayerCall:
    """Checks a call's inputs and prepares it (``layer_forward``'s arguments; ``span_ids``/``kv_span_ids``:
    bidirectional span ids, ``_body.span_sides``; ``stored``: the parameters' storage specs, by name, where
    they are stored beyond the compute layout: those enter the ``shard_map`` as stored and are gathered
    there, see ``_unshard_params``; ``split_over_tp``: ``x`` and the output split over tp along the features,
    ``CPAttention``'s)."""
    _check_input("x", x_BSD, spec.in_features)
    if split_over_tp:
        _check_split(spec, mesh, kv_x)
    B, S, _ = x_BSD.shape
    for name, a in zip(("inputs_k", "inputs_v"), kv_x):
        _check_input(name, a, spec.in_features, B)
    S_kv = kv_x[0].shape[1] if kv_x else S
    if len(kv_x) == 2 and kv_x[1].shape != kv_x[0].shape:
        raise ValueError(f"inputs_v.shape={kv_x[1].shape} must equal inputs_k.shape={kv_x[0].shape}.")
    dtype = jnp.dtype(x_BSD.dtype if dtype is None else dtype)
    check_dtype("dtype", dtype)
    # The call's own settings: the spec is validated again only when they change it.
    changes = dict(local_window_size=local_window_size, scale=scale, kernel=kernel_for_dtype(spec.kernel, dtype),
                   **_cross_changes(spec, bool(kv_x)))
    changes = {name: value for name, value in changes.items() if getattr(spec, name) != value}
    spec = spec.replace(**changes) if changes else spec
    spec, _ = spec.resolve(mesh, batch=B, seq_len=S_kv, itemsize=dtype.itemsize, dtype=dtype,
                           has_segments=segment_ids is not None, has_spans=span_ids is not None)
    layout = spec.layout(mesh_dims(mesh))
    check_seq_batch(B, S, layout.dims)
    check_seq_batch(B, S_kv, layout.dims, name="the key/value inputs' seq_len")
    sides = metadata_sides(positions, segment_ids, kv_positions, kv_segment_ids, B, S, S_kv)
    meta, meta_specs = placed_metadata(sides[0], sides[1], B, S, mesh, *sides[2:], spans=(span_ids, kv_span_ids))
    specs = _compute_specs(spec, layout)
    params, param_specs_, inside = _enter_params(params, specs, stored or {}, mesh)
    x_spec = SPLIT_X_SPEC if split_over_tp else X_SPEC
    args = [params, place(x_BSD, mesh, x_spec), *(place(a, mesh, X_SPEC) for a in kv_x), meta]
    in_specs = [param_specs_, x_spec] + [X_SPEC] * len(kv_x) + [meta_specs]
    out_specs = (x_spec, P(TP)) if spec.record_max_logits else x_spec
    kwargs = dict(spec=spec, layout=layout, dtype=dtype) | ({"stored": inside} if inside else {}) | (
        {"split": True} if split_over_tp else {})
    return LayerCall(mesh, spec, layout, B, S, args, in_specs, out_specs, kwargs)


def _check_split(spec: AttentionSpec, mesh, kv_x: tuple) -> None:
    t = mesh_dims(mesh).t
    if kv_x:
        raise ValueError("split_over_tp=True is for self-attention; cross attention (inputs_k/inputs_v/inputs_kv) "
                         "takes its inputs whole: pass split_over_tp=False.")
    for name, n in (("in_features", spec.in_features), ("out_features", spec.out_features or spec.in_features)):
        if n % t:
            raise ValueError(f"split_over_tp=True splits the features over tp={t}, but {name}={n} is not a multiple "
                             f"of it; pass split_over_tp=False.")


def _enter_params(params: dict, specs: dict, stored: dict, mesh) -> tuple[dict, dict, tuple]:
    """``(params, in_specs, inside)``: each parameter placed as it enters the layer's ``shard_map``. One
    stored as its compute spec plus storage axes enters as stored and is gathered inside (``inside``:
    ``(name, stored, compute)``); any other storage layout is put in the compute layout outside."""
    placed, in_specs, inside = {}, {}, []
    for k, sp in specs.items():
        st = None if stored.get(k) is None else P(*stored[k])
        if st is not None and gather_dims(st, sp, params[k].ndim):  # (the same layout: no dims, falsy)
            placed[k], in_specs[k] = place(params[k], mesh, st), st
            inside.append((k, st, sp))
        else:
            placed[k], in_specs[k] = place(params[k], mesh, sp), sp  # (any other layout: resharded)
    return placed, in_specs, tuple(inside)


def layer_forward(params: dict, x_BSD, *, mesh, **kw):
    """Applies the layer to a global ``x [B, S, D]``; returns ``y [B, S, out_features]`` sharded like x (and
    ``max_logits [H]`` with ``spec.record_max_logits``). Cross attention: ``kv_x`` (``kv_inputs``'),
    ``[B, S_kv, D]`` each, at ``kv_positions`` with ``kv_segment_ids`` (``metadata_sides``).
    Keywords: ``layer_call``'s."""
    call = layer_call(params, x_BSD, mesh=mesh, **kw)
    fn = partial(_layer_shard, **call.kwargs)
    return shard_call(fn, mesh, tuple(call.in_specs), call.out_specs, call.args)


def gather_stored(params: dict, stored: dict, spec: AttentionSpec, mesh) -> dict:
    """Parameters stored sharded beyond their compute layout (``AttentionSharding``, e.g. FSDP) gathered to
    it explicitly (``_mesh.gather``: their gradients become reduce-scatters); the rest as they are."""
    specs = compute_specs(spec, mesh)
    return {k: v if stored.get(k) is None or P(*stored[k]) == specs[k] else gather(v, mesh, P(*stored[k]), specs[k])
            for k, v in params.items()}


def compute_specs(spec: AttentionSpec, mesh) -> dict[str, P]:
    """The compute layout of the layer's parameters on ``mesh`` (by name)."""
    return _compute_specs(spec, spec.layout(mesh_dims(mesh)))
