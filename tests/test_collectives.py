"""Every all-reduce algorithm equals psum and its numpy twin; the cost model matches the compiled HLO."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.comm import collectives as C
from jaxpar.comm import cost as K
from jaxpar.mesh import DATA


def submesh(n):
    return Mesh(np.array(jax.devices()[:n]), (DATA,))


def per_device_inputs(n, shape, dtype, seed=0):
    """xs[i] is device i's input; the rows must differ or an equivalence test could not fail."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.int32:
        xs = rng.integers(-50, 50, size=(n, *shape)).astype(np.int32)
    else:
        xs = (rng.normal(size=(n, *shape)) * 3).astype(dtype)
    assert len({xs[i].tobytes() for i in range(n)}) == n, "per-device inputs must differ"
    return xs


def run_all(xs, comm_dtype=None):
    """Every algorithm x op on the stacked inputs, one compile; returns {(alg, op): per-device outputs}."""
    def body(x):
        x = x[0]
        return {(a, op): C.all_reduce(x, DATA, a, op, comm_dtype)[None] for a in C.ALGORITHMS for op in C.OPS}

    f = jax.jit(jax.shard_map(body, mesh=submesh(len(xs)), in_specs=P(DATA), out_specs=P(DATA)))
    return {k: np.asarray(v) for k, v in f(xs).items()}


CASES = [(n, shape, np.float32) for n in (1, 2, 3, 4, 8) for shape in [(), (7,), (2, 3, 4)]]
CASES += [(n, (2, 3, 5), dt) for n in (3, 8) for dt in (np.int32, jnp.bfloat16)]
# 9 elements on 8 devices: chunks of 2, so chunks 5..7 start past the end (the ring must leave them out, not
# slice [: size - j*c] with a negative bound); every case above ends inside its last chunk
CASES += [(8, (3, 3), np.float32)]


@pytest.mark.parametrize("n,shape,dtype", CASES)
def test_every_algorithm_equals_psum_and_its_twin(n, shape, dtype):
    xs = per_device_inputs(n, shape, dtype)
    out = run_all(xs)
    exact_sum = xs.astype(np.float64).sum(0)
    for (alg, op), got in out.items():
        assert got.shape == (n, *shape)
        assert (got == got[0]).all(), f"{alg} {op}: devices disagree"  # replicas must stay in lockstep
        psum = out[("psum", op)]
        assert got.dtype == psum.dtype, (alg, op)
        ref = C.REFERENCES[alg](xs, op)
        if np.dtype(dtype) == np.int32 and op == "sum":
            np.testing.assert_array_equal(got, psum)
            np.testing.assert_array_equal(got, ref)
        elif np.dtype(dtype) == np.float32 or np.dtype(dtype) == np.int32:
            np.testing.assert_allclose(got, psum, rtol=1e-6, atol=1e-5, err_msg=f"{alg} {op}")
            if alg != "psum" and op == "sum":  # the twin adds in the device's order: bit for bit
                np.testing.assert_array_equal(got, ref, err_msg=f"{alg} twin")
            else:
                np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5, err_msg=f"{alg} twin")
        else:  # bf16: N roundings of 2^-8 each
            want = exact_sum / (n if op == "mean" else 1)
            np.testing.assert_allclose(got.astype(np.float32), np.broadcast_to(want, got.shape), rtol=0.05, atol=0.3)
            np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=0.02, atol=0.1)
    if np.dtype(dtype) != np.int32:  # sum and mean really differ, and mean = sum / N
        np.testing.assert_allclose(out[("ring", "mean")].astype(np.float32),
                                   out[("ring", "sum")].astype(np.float32) / n, rtol=0.01, atol=1e-5)
    if n > 1:
        assert not np.allclose(out[("ring", "sum")], xs), "the all-reduce must change the inputs"


@pytest.mark.parametrize("n", [3, 4])
def test_reduce_broadcast_through_any_root_equals_its_twin(n):
    """`root` moves the bottleneck: every device ends with the root's total (the root's own x first, then devices
    root+1, root+2, ... as the twin adds them, so the sum bit for bit), whichever device the root is."""
    xs = per_device_inputs(n, (2, 3), np.float32, seed=n)

    def body(x):
        return {(r, op): C.reduce_broadcast_all_reduce(x[0], DATA, op, root=r)[None] for r in range(n)
                for op in C.OPS}

    out = jax.jit(jax.shard_map(body, mesh=submesh(n), in_specs=P(DATA), out_specs=P(DATA)))(xs)
    for (root, op), got in out.items():
        got = np.asarray(got)
        want = C.reduce_broadcast_all_reduce_ref(xs, op, root)
        if op == "sum":
            np.testing.assert_array_equal(got, want, err_msg=f"root {root}")
        else:  # the division rounds apart (as in test_every_algorithm_equals_psum_and_its_twin)
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"root {root}")
        np.testing.assert_allclose(got[0], xs.sum(0) / (n if op == "mean" else 1), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 3])
def test_booleans_are_counted_as_psum_counts_them(n):
    """bool + bool is a logical OR: the hand-written algorithms OR-ed a mask across devices where psum counts it
    (int32; the mean a float32 fraction), a silent wrong number (QA 51). Their twins are checked the same way."""
    xs = np.array([[True, True, False, True, False], [False, True, False, False, False],
                   [True, True, False, False, True]])[:n]
    out = run_all(xs)
    count = xs.sum(0, dtype=np.int32)
    assert n == 1 or (count > 1).any()  # a count above one, which an OR cannot give
    for (alg, op), got in out.items():
        want = count if op == "sum" else count / np.float32(n)
        assert got.dtype == (np.int32 if op == "sum" else np.float32), (alg, op, got.dtype)
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6, err_msg=f"{alg} {op}")
        np.testing.assert_allclose(C.REFERENCES[alg](xs, op), got, rtol=1e-6, err_msg=f"{alg} {op} twin")


def test_comm_dtype_follows_torch_bf16_compress_hook():
    n = 4
    xs = per_device_inputs(n, (7,), np.float32)
    out = run_all(xs, comm_dtype=jnp.bfloat16)
    bf = xs.astype(jnp.bfloat16)
    for alg in C.ALGORITHMS:
        s, m = out[(alg, "sum")], out[(alg, "mean")]
        assert s.dtype == np.float32 and m.dtype == np.float32  # cast back to the input dtype
        want_m = C.REFERENCES["ring" if alg == "psum" else alg](bf / n, "sum").astype(np.float32)  # divide first
        np.testing.assert_allclose(m, want_m, rtol=0.02, atol=0.05)
        np.testing.assert_allclose(s, xs.sum(0)[None].repeat(n, 0), rtol=0.05, atol=0.2)
        assert not np.array_equal(s, xs.sum(0)[None].repeat(n, 0))  # bf16 rounding really happened


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="algorithm='tree'"):
        C.all_reduce(jnp.ones(3), DATA, "tree")
    with pytest.raises(ValueError, match="op='max'"):
        C.all_reduce(jnp.ones(3), DATA, "ring", "max")
    with pytest.raises(ValueError, match="no cost model"):
        K.comm_cost("tree", 4, 100)


def test_comm_dtype_mean_divides_each_input_by_n_in_bf16_before_the_sum():
    """torch's bf16_compress_hook divides the bf16 tensor by world_size and then all-reduces. With N = 3 (not a power
    of two, so the division rounds) dividing after the sum gives other bits: the hand-written algorithms must equal
    their twins on bf16(x) / N bit for bit (test_comm_dtype_follows_torch_bf16_compress_hook's N = 4 cannot tell)."""
    n = 3
    xs = per_device_inputs(n, (2, 7), np.float32)
    out = run_all(xs, comm_dtype=jnp.bfloat16)
    bf, n_bf = xs.astype(jnp.bfloat16), np.asarray(n, jnp.bfloat16)
    for alg in C.ALGORITHMS:
        twin = C.REFERENCES["ring" if alg == "psum" else alg]
        want = twin(bf / n_bf, "sum").astype(np.float32)
        divided_after = (twin(bf, "sum") / n_bf).astype(np.float32)
        assert not np.array_equal(want, divided_after)  # the two orders really differ on these inputs
        if alg == "psum":  # XLA adds in float32: only close
            np.testing.assert_allclose(out[(alg, "mean")], want, rtol=0.02, atol=0.05)
        else:
            np.testing.assert_array_equal(out[(alg, "mean")], want, err_msg=alg)


def test_tree_all_reduce_reduces_every_leaf_with_the_algorithm_op_and_comm_dtype():
    """tree_all_reduce passes the algorithm, the op and comm_dtype on to every leaf: a mean of an int32 leaf is
    psum's float32 mean; a bf16-compressed sum is the ring's bf16 twin, bit for bit."""
    n = 4
    xs = {"w": per_device_inputs(n, (5,), np.float32, seed=2), "k": per_device_inputs(n, (2, 2), np.int32, seed=3)}

    def body(t):
        t = jax.tree.map(lambda a: a[0], t)
        mean = C.tree_all_reduce(t, DATA, "ring", "mean")
        compressed = C.tree_all_reduce({"w": t["w"]}, DATA, "ring", "sum", comm_dtype=jnp.bfloat16)
        return jax.tree.map(lambda a: a[None], (mean, compressed))

    mean, compressed = jax.jit(jax.shard_map(body, mesh=submesh(n), in_specs=P(DATA), out_specs=P(DATA)))(xs)
    for k, v in xs.items():
        assert mean[k].dtype == np.float32, k
        np.testing.assert_allclose(mean[k], np.broadcast_to(v.astype(np.float64).mean(0), v.shape), rtol=1e-6)
    want = C.ring_all_reduce_ref(xs["w"].astype(jnp.bfloat16), "sum").astype(np.float32)
    np.testing.assert_array_equal(compressed["w"], want)
    assert compressed["w"].dtype == np.float32 and not np.allclose(compressed["w"], xs["w"].sum(0), rtol=1e-6)


@pytest.mark.parametrize("alg", ["ring", "reduce_broadcast", "all_to_all"])
def test_a_zero_size_array_all_reduces_to_itself(alg):
    """A zero-size leaf (a 0-wide layer's bias) in tree_all_reduce: nothing to add, the same empty shape and dtype
    back, as psum gives (the ring used to build its chunks from nothing: concatenate of an empty list)."""
    xs = np.zeros((4, 0, 3), np.float32)

    def body(x):
        return {op: (C.all_reduce(x[0], DATA, alg, op)[None], C.psum_all_reduce(x[0], DATA, op)[None])
                for op in C.OPS}

    out = jax.jit(jax.shard_map(body, mesh=submesh(4), in_specs=P(DATA), out_specs=P(DATA)))(xs)
    for op, (got, psum) in out.items():
        assert got.shape == psum.shape == (4, 0, 3) and got.dtype == psum.dtype, (op, got.shape, got.dtype)


@pytest.mark.parametrize("root", [-1, 4, 5])
def test_reduce_broadcast_refuses_a_root_outside_the_axis(root):
    f = jax.shard_map(lambda x: C.reduce_broadcast_all_reduce(x, DATA, root=root), mesh=submesh(4),
                      in_specs=P(DATA), out_specs=P(DATA))
    with pytest.raises(ValueError, match=rf"root={root} must be a device index on axis 'data' of size 4; use 0..3"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((4, 2), np.float32))


def test_cost_model_numbers():
    s = 1000
    ring = K.comm_cost("ring", 8, s)
    assert (ring.steps, ring.sent_per_device, ring.master_sent) == (14, 2 * 7 / 8 * s, 2 * 7 / 8 * s)
    rb = K.comm_cost("reduce_broadcast", 8, s)
    assert (rb.steps, rb.sent_per_device, rb.master_sent) == (14, s, 7 * s)
    a2a = K.comm_cost("all_to_all", 8, s)
    assert (a2a.steps, a2a.sent_per_device, a2a.master_sent) == (7, 7 * s, 7 * s)
    ps = K.comm_cost("psum", 8, s)
    assert ps.source == "xla" and ps.sent_per_device == ring.sent_per_device and ring.source == "model"
    assert K.comm_cost("ring", 4, 7 * 4, itemsize=4).sent_per_device == 6 * 2 * 4  # 7 -> 4 chunks of 2 padded
    assert K.comm_cost("ring", 1, s).sent_per_device == 0
    assert K.bus_bandwidth(10.0, 8) == 10.0 * 14 / 8
    assert ring.time(1e-3, 1e3) == pytest.approx(14e-3 + 1.75)


def compiled(alg, n, size, dtype=jnp.float32):
    f = jax.jit(jax.shard_map(lambda x: C.ALGORITHMS[alg](x, DATA), mesh=submesh(n), in_specs=P(DATA),
                              out_specs=P(DATA)))
    return f.lower(jax.ShapeDtypeStruct((n * size,), dtype)).compile()


@pytest.mark.parametrize("n,size", [(4, 256), (4, 257), (8, 64), (8, 61)])
def test_ring_sends_two_n_minus_one_over_n_of_the_buffer(n, size):
    hlo = compiled("ring", n, size)
    colls = K.hlo_collectives(hlo)
    assert [c.kind for c in colls] == ["collective-permute"] * 2 * (n - 1)
    want = K.comm_cost("ring", n, 4 * size, itemsize=4).sent_per_device
    assert want == 2 * (n - 1) * 4 * -(-size // n)
    if size % n == 0:
        assert want == 2 * (n - 1) / n * 4 * size  # the lower bound, exactly
    assert K.hlo_bytes_per_device(hlo) == [want] * n
    assert K.hlo_bytes_per_device(hlo, direction="received") == [want] * n


def test_other_algorithms_bytes_in_the_hlo():
    n, size = 4, 100
    s = 4 * size
    rb = compiled("reduce_broadcast", n, size)
    assert len(K.hlo_collectives(rb)) == 2 * (n - 1)
    assert K.hlo_bytes_per_device(rb) == [(n - 1) * s] + [s] * (n - 1)  # the root is the bottleneck
    assert K.hlo_bytes_per_device(rb, direction="received") == [(n - 1) * s] + [s] * (n - 1)
    a2a = compiled("all_to_all", n, size)
    assert len(K.hlo_collectives(a2a)) == n - 1
    assert K.hlo_bytes_per_device(a2a) == [(n - 1) * s] * n
    ps = K.hlo_collectives(compiled("psum", n, size))
    assert [(c.kind, c.shape, c.dtype, c.nbytes) for c in ps] == [("all-reduce", (size,), "f32", s)]
    assert K.hlo_bytes_per_device(compiled("psum", n, size)) == [2 * (n - 1) / n * s] * n


def test_bf16_ring_moves_two_byte_words():
    n, size = 4, 256
    colls = K.hlo_collectives(compiled("ring", n, size, jnp.bfloat16))
    assert {c.dtype for c in colls} == {"u16"}  # XLA:CPU would widen a bf16 ppermute to f32
    assert sum(c.nbytes for c in colls) == 2 * (n - 1) * 2 * size // n


ASYNC_HLO = """HloModule m, num_partitions=4
ENTRY %e {
  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %p), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) %cp-start)
  %ar-start = (f32[16]{0}, bf16[4]{0}) all-reduce-start(f32[16]{0} %a, bf16[4]{0} %b), replica_groups={{0,1,2,3}}, to_apply=%add
  %ar-done = (f32[16]{0}, bf16[4]{0}) all-reduce-done((f32[16]{0}, bf16[4]{0}) %ar-start)
  %ag-start = (f32[2]{0}, f32[4]{0}) all-gather-start(f32[2]{0} %c), replica_groups=[2,2]<=[4], dimensions={0}
  %ag-done = f32[4]{0} all-gather-done((f32[2]{0}, f32[4]{0}) %ag-start)
  ROOT %rs = f32[2]{0} reduce-scatter(f32[8]{0} %d), replica_groups={}, dimensions={0}, to_apply=%add
}"""


def test_hlo_parser_counts_async_pairs_once_and_splits_combined_ops():
    colls = K.hlo_collectives(ASYNC_HLO)
    assert [(c.name, c.kind, c.shape, c.dtype, c.nbytes) for c in colls] == [
        ("cp-start", "collective-permute", (8,), "f32", 32),
        ("ar-start", "all-reduce", (16,), "f32", 64),
        ("ar-start", "all-reduce", (4,), "bf16", 8),
        ("ag-start", "all-gather", (4,), "f32", 16),
        ("rs", "reduce-scatter", (2,), "f32", 8),
    ]
    assert colls[0].pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert colls[3].groups == ((0, 1), (2, 3))
    assert K.hlo_num_devices(ASYNC_HLO) == 4
    # permute 32 + all-reduce 2*3/4*72 + all-gather 1/2*16 + reduce-scatter 3*8
    assert K.hlo_bytes_per_device(ASYNC_HLO) == [32 + 108 + 8 + 24] * 4


# ---- reduce-scatter: the ring that stands in for XLA:CPU's gloo reduce-scatter across processes ---------------

@pytest.mark.parametrize("n,shape,dim,dtype", [(2, (6, 3), 0, np.float32), (4, (3, 8, 2), 1, np.float32),
                                               (8, (16,), 0, np.float32), (3, (2, 9), 1, np.int32),
                                               (4, (8, 5), 0, jnp.bfloat16)])
def test_ring_reduce_scatter_equals_psum_scatter(n, shape, dim, dtype):
    """Each device keeps part i of the sum, as lax.psum_scatter(tiled=True): int32 bit for bit, floats to the
    rounding of another addition order; the parts really differ (no device returns the whole sum)."""
    xs = per_device_inputs(n, shape, dtype)

    def body(x):
        x = x[0]
        return (C.ring_reduce_scatter(x, DATA, dim)[None],
                jax.lax.psum_scatter(x, DATA, scatter_dimension=dim, tiled=True)[None])

    f = jax.jit(jax.shard_map(body, mesh=submesh(n), in_specs=P(DATA), out_specs=P(DATA)))
    ring, native = (np.asarray(a, np.float64) for a in f(xs))
    want = np.stack(np.split(xs.astype(np.float64).sum(0), n, axis=dim))
    assert ring.shape == want.shape and not np.allclose(ring[0], ring[1])
    tol = 2e-2 if np.dtype(dtype) == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(ring, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(ring, native, rtol=tol, atol=tol)
    if np.dtype(dtype) == np.int32:
        np.testing.assert_array_equal(ring, native)
    with pytest.raises(ValueError, match="does not split into 5 equal parts"):
        jax.shard_map(lambda x: C.ring_reduce_scatter(x, DATA), mesh=submesh(5), in_specs=P(DATA),
                      out_specs=P(DATA))(np.zeros((5, 7), np.float32))


@pytest.fixture
def ring_reduce_scatter(monkeypatch):
    """Route jaxpar's reduce-scatters through the ring, as across processes over gloo (it is one process here)."""
    monkeypatch.setattr(C, "native_reduce_scatter_is_safe", lambda: False)


def test_gloo_across_processes_is_the_unsafe_case():
    assert C.native_reduce_scatter_is_safe()  # this run: one process, XLA's own
    assert not C.native_reduce_scatter_is_safe(2, "cpu", "gloo")
    assert C.native_reduce_scatter_is_safe(2, "cpu", "mpi") and C.native_reduce_scatter_is_safe(2, "gpu", "gloo")
    assert C.native_reduce_scatter_is_safe(1, "cpu", "gloo")


@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_transposes_to_the_ring(tiled, ring_reduce_scatter):
    """jaxpar's all_gather: lax's forward, and a backward (a reduce-scatter) equal to lax.all_gather's, made of
    collective-permutes only."""
    n, xs = 4, per_device_inputs(4, (2, 3), np.float32)
    w = per_device_inputs(4, (8, 3) if tiled else (4, 2, 3), np.float32, seed=1)

    def grads(gather):
        def loss(x, w):
            return jnp.sum(gather(x[0], DATA, axis=0, tiled=tiled) * w[0])
        return jax.shard_map(jax.grad(loss), mesh=submesh(n), in_specs=(P(DATA), P(DATA)), out_specs=P(DATA))

    ours, lax_ = jax.jit(grads(C.all_gather)), jax.jit(grads(jax.lax.all_gather))
    np.testing.assert_allclose(ours(xs, w), lax_(xs, w), rtol=1e-6, atol=1e-6)
    hlo = ours.lower(xs, w).compile().as_text()
    assert "reduce-scatter(" not in hlo and "collective-permute" in hlo and "all-gather" not in hlo.split("ENTRY")[0]


def test_iota_replica_groups_with_a_transpose_are_the_strided_groups():
    """XLA prints strided replica groups (a data-parallel reduction on a [data, tensor] mesh) in iota form with a
    transpose: [2,4]<=[4,2]T(1,0) is {0,2,4,6}, {1,3,5,7}, not the contiguous rows [2,4]<=[8] names (the tensor
    groups, which tensor.tensor_all_reduces tells apart by their groups)."""
    strided = ("HloModule m, num_partitions=8\nENTRY %e {\n  ROOT %ar = f32[8]{0} all-reduce(f32[8]{0} %a), "
               "replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add\n}")
    (c,) = K.hlo_collectives(strided)
    assert c.groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    (rows,) = K.hlo_collectives(strided.replace("[4,2]T(1,0)", "[8]"))
    assert rows.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_received_bytes_of_a_one_way_permute_are_counted_at_its_targets():
    """A collective-permute that is not a cycle (a pipeline's send to the next stage: 0 -> 1 -> 2) sends from its
    sources and arrives at its targets: the first device sends and receives nothing back, the last only receives."""
    hlo = ("HloModule m, num_partitions=3\nENTRY %e {\n  ROOT %cp = f32[8]{0} collective-permute(f32[8]{0} %p), "
           "channel_id=1, source_target_pairs={{0,1},{1,2}}\n}")
    assert K.hlo_bytes_per_device(hlo) == [32, 32, 0]
    assert K.hlo_bytes_per_device(hlo, direction="received") == [0, 32, 32]


def test_zero_3_traffic_gathers_frozen_weights_for_the_forward_and_the_backward():
    """Stage 3's model: each trained unit all-gathered twice (forward, backward) and reduce-scattered once; a frozen
    weight's pieces are all-gathered twice as well and never reduced (ZeRO-3 partitions every parameter)."""
    n, trained, frozen = 4, 400, 800
    got = K.zero_traffic(3, n, [trained], [trained], frozen_bytes=[frozen])
    assert got == {"all-gather": 2 * (3 / 4 * trained + 3 / 4 * frozen), "reduce-scatter": 3 * trained / 4}
    assert K.zero_traffic(3, n, [trained], [trained])["all-gather"] == 2 * 3 / 4 * trained


def test_hlo_parser_counts_each_element_type_at_its_width():
    """A collective's bytes are its elements times their width, for every element type the parser knows, widths
    taken from numpy and ml_dtypes (an fp16 or fp8 gradient all-reduce moves 2 or 1 bytes an element)."""
    import ml_dtypes

    numpy_types = {"pred": np.bool_, "s8": np.int8, "u8": np.uint8, "s16": np.int16, "u16": np.uint16,
                   "f16": np.float16, "bf16": ml_dtypes.bfloat16, "s32": np.int32, "u32": np.uint32,
                   "f32": np.float32, "s64": np.int64, "u64": np.uint64, "f64": np.float64, "c64": np.complex64,
                   "c128": np.complex128, "f8e4m3fn": ml_dtypes.float8_e4m3fn, "f8e5m2": ml_dtypes.float8_e5m2}
    assert sorted(numpy_types) == sorted(K.DTYPE_BYTES)
    for dt, np_type in numpy_types.items():
        hlo = (f"HloModule m, num_partitions=2\nENTRY %e {{\n  ROOT %ar = {dt}[3,2]{{1,0}} all-reduce({dt}[3,2]{{1,0}} "
               "%a), replica_groups={{0,1}}, to_apply=%add\n}")
        (c,) = K.hlo_collectives(hlo)
        assert (c.dtype, c.shape, c.nbytes) == (dt, (3, 2), 6 * np.dtype(np_type).itemsize), dt
