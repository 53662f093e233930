"""Gradient buckets reduced from inside the backward pass (torch DDP's autograd hooks), and the proof in the HLO.

Roughly, for a bucket plan [b0, b1, ...] (b0 holds the last layers' leaves and is reduced first):
    forward:   p[b], tok = hook(p[b], acc[b], tok)   for b in reversed(plan), before the model uses p
    backward:  hook's bwd:  flat = concat(ct[b] + acc[b]) + tok';  flat = all_reduce(flat);  ct[b] = split(flat)
so bucket b's collective depends only on its own gradients and can run while earlier layers' gradients are
still being computed. `tok` is an exact 0.0 that carries a data dependency from one bucket's reduced buffer
to the next one's input: the reductions stay one collective per bucket, issued in plan order (torch's single
communication stream); without it XLA's all-reduce combiner merges independent reductions into one.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.comm.buckets import flatten_bucket, reduce_buckets, unflatten_bucket

Reduce = Callable[[jax.Array], jax.Array]  # flat bucket buffer -> its sum over the data axis
Plan = Sequence[Sequence[int]]  # buckets of leaf indices (into jax.tree.leaves(params)), in reduction order


def forward_leaf_order(model: nnx.Module, wrt=nnx.Param, registration: bool = True) -> list[int]:
    """Indices of the leaves of `nnx.split(model, wrt, ...)[1]` (the trained params) in forward order.

    The order comes from the model's `layers` sequence (nnx.Sequential's, models.as_layers): each layer's
    leaves, layer by layer, within a layer in the order it defines them (torch's registration order: a Linear's
    kernel before its bias, a GPT block's ln_1, attn, ln_2, mlp), a leaf two layers share (a tied embedding) at
    its first use; a layer built on the fly around the model's modules (GPT's Embedding and LMHead) counts
    them. Buckets fill in the reverse of this order, the order torch's autograd readies the gradients, and that
    is not the reverse of registration for every layer: a Linear's bias is ready before its weight (addmm's
    backward hands the weight's gradient on through a transpose), but a convolution's or a norm's weight is
    ready before its bias (one backward node yields both; torch 2.13, DDP's buckets and post-accumulate-grad
    hooks alike), so those layers (_weight_ready_first) list their bias first. Leaves that no layer in `layers`
    holds, and every leaf of a model without `layers`, follow in flatten (path-sorted) order, which is not the
    forward order in general (AlexNet's `classifier` sorts before `features`). The definition order is that of
    a model built by its __init__: nnx.merge and nnx.eval_shape rebuild modules with their attributes sorted
    by name (a Linear's bias then kernel, a GPT block's attn before ln_1), so pass the model itself
    (Objective.of keeps its order as `leaf_order`, which DDP and ZeRO take).

    ``registration=False``: each module's leaves and sub-modules in name order (its flatten order), nothing
    reversed -- ZeRO stage 3's per-leaf plan, whose compiled step keeps fewer temporaries and prefetches each
    backward re-gather ahead of the first reduce-scatter so (tests/test_zero.py; in torch's order a 256-wide
    Linear's stage-3 temporaries grew 0.81 of its weights per layer against 0.59).
    """
    state = nnx.split(model, wrt, ...)[1]
    index = {tuple(map(str, _path_of(p))): i for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0])}
    leaf_of = {id(node): index[key] for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)
               and (key := tuple(map(str, path))) in index}
    order: list[int] = []
    seen: set[int] = set()
    try:  # `layers` as a sequence of layers; a model's own attribute of that name holding one module is not one
        layers = list(getattr(model, "layers", None) or ())
    except TypeError:
        layers = []
    for layer in layers:  # a plain function (relu) holds no Variable
        for var in _defined_variables(layer, seen, registration):
            if id(var) in leaf_of and leaf_of[id(var)] not in order:
                order.append(leaf_of[id(var)])
    return order + [i for i in range(len(index)) if i not in order]


def _defined_variables(node, seen: set[int], registration: bool = True) -> list:
    """The Variables under `node` in the order its attributes were set (lists and dicts in their own order), each
    Variable and Module once over the calls sharing `seen`; `registration` False: a module's attributes in name
    order."""
    if id(node) in seen:
        return []
    if isinstance(node, nnx.Variable):
        seen.add(id(node))
        return [node]
    if isinstance(node, (list, tuple)):
        items = list(node)
    elif isinstance(node, dict):
        items = list(node.values())
    elif isinstance(node, nnx.Module):
        seen.add(id(node))
        attrs = [(k, v) for k, v in vars(node).items() if not k.startswith("_pytree__")]
        items = [v for _, v in (attrs if registration else sorted(attrs, key=lambda kv: kv[0]))]
        if registration and isinstance(node, _weight_ready_first()):  # torch readies their weight first
            items = items[::-1]
    else:
        return []
    return [var for v in items for var in _defined_variables(v, seen, registration)]


def _weight_ready_first() -> tuple[type, ...]:
    """The layers whose torch twins' weight gradient is ready before the bias's (one backward node computes both:
    torch 2.13's Conv1d/Conv2d, BatchNorm2d, GroupNorm, LayerNorm; a Linear's bias comes first)."""
    from jaxpar.models.layers import Conv2d  # jaxpar.models imports jaxpar.comm

    return (Conv2d, nnx.Conv, nnx.LayerNorm, nnx.BatchNorm, nnx.GroupNorm)


def leaf_names(params) -> list[str]:
    """'conv1.kernel'-style names of the leaves of an nnx.State, in flatten order (for plans and reports)."""
    return [".".join(map(str, _path_of(p))) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _path_of(keypath) -> tuple:
    keys = []
    for k in keypath:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        keys.append(name)
    return tuple(keys[:-1] if keys and keys[-1] == "value" else keys)  # drop the Variable's `.value`


def zero_after(*xs: jax.Array) -> jax.Array:
    """An exact float32 0.0 that XLA cannot compute before every x exists (nothing compares > inf, not even NaN)."""
    firsts = [x.reshape(-1)[:1].astype(jnp.float32) for x in xs if x.size]
    if not firsts:
        return jnp.zeros((), jnp.float32)
    return jnp.where(jnp.concatenate(firsts).max() > jnp.inf, 1.0, 0.0).astype(jnp.float32)


def tie(tree: Any, token: jax.Array) -> Any:
    """`tree` with the exact 0.0 `token` added to its float arrays: they now depend on what made the token."""
    return jax.tree.map(lambda a: a + token.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def reduce_bucket(leaves: Sequence[jax.Array], token: jax.Array, reduce: Reduce):
    """(reduced leaves, next token): the bucket flattened into one buffer, one collective, split back."""
    flat = reduce(flatten_bucket(leaves) + token.astype(leaves[0].dtype))
    return unflatten_bucket(flat, [g.shape for g in leaves]), zero_after(flat)


def reduce_after_backward(grads: list[jax.Array], plan: Plan, reduce: Reduce) -> list[jax.Array]:
    """Overlap off: every bucket reduced, in plan order, only once ALL local gradients exist."""
    token = [zero_after(*grads)]

    def chained(flat: jax.Array) -> jax.Array:  # buckets.reduce_buckets calls it once per bucket, in order
        out = reduce(flat + token[0].astype(flat.dtype))
        token[0] = zero_after(out)
        return out

    return reduce_buckets(list(grads), plan, chained)


def _bucket_hook(reduce: Reduce):
    """identity(leaves, acc, token) whose backward reduces (cotangent + acc) with one collective."""

    @jax.custom_vjp
    def hook(leaves, acc, token):
        return leaves, token

    def fwd(leaves, acc, token):
        return (leaves, token), acc

    def bwd(acc, cts):
        ct_leaves, ct_token = cts
        if acc is not None:  # micro-steps before the last one: their local sums join this reduction
            ct_leaves = [c + a for c, a in zip(ct_leaves, acc)]
        reduced, token = reduce_bucket(ct_leaves, ct_token, reduce)
        return reduced, jax.tree.map(jnp.zeros_like, acc), token

    hook.defvjp(fwd, bwd)
    return hook


def hook_buckets(leaves: list[jax.Array], plan: Plan, reduce: Reduce, acc: list[jax.Array] | None = None):
    """`leaves` with each bucket wrapped in its reduction hook; the gradient w.r.t. them is reduced in place.

    Applied in forward order (the last bucket first), so the backward meets the first bucket first and the
    token chain orders the reductions b0, b1, ...
    """
    hook = _bucket_hook(reduce)
    out, token = list(leaves), jnp.zeros((), jnp.float32)
    for bucket in reversed(plan):
        part_acc = None if acc is None else [acc[i] for i in bucket]
        wrapped, token = hook([leaves[i] for i in bucket], part_acc, token)
        for i, w in zip(bucket, wrapped):
            out[i] = w
    return out


# ---- reading the compiled schedule -------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "collective-permute", "all-to-all", "all-gather", "reduce-scatter")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def entry_schedule(hlo_text: str) -> list[tuple[str, str, str]]:
    """(name, opcode, result shape) of the entry computation's instructions in scheduled order.

    `hlo_text` is `jitted.lower(...).compile().as_text()`: the module after scheduling, whose entry
    computation lists instructions in the order they are issued.
    """
    lines = hlo_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("hlo_text has no ENTRY computation; pass compiled.as_text() of a jitted function.")
    out = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if m:
            name, shape, opcode = m.group(1), m.group(2), m.group(3)
            out.append((name, opcode.removesuffix("-start"), shape))
    return out


def collective_positions(schedule: list[tuple[str, str, str]], kinds: Sequence[str] = COLLECTIVES) -> list[int]:
    """Positions in `schedule` of the collective instructions (async *-start counts, *-done does not)."""
    return [i for i, (_, op, _) in enumerate(schedule) if op in kinds]


def producer_positions(schedule: list[tuple[str, str, str]], shape: str,
                       opcodes: Sequence[str] = ("dot", "convolution", "fusion", "custom-call")) -> list[int]:
    """Positions of compute instructions whose result shape is `shape` (e.g. 'f32[16,32]': a weight gradient)."""
    return [i for i, (_, op, s) in enumerate(schedule) if op in opcodes and s.split("{")[0] == shape]
