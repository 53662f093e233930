"""Class targets outside the model's outputs (and token ids outside a table the model looks them up in) are
refused by put_batch, before any work, when they are host values; torch's CrossEntropyLoss raises 'Target 10 is
out of bounds', a jitted step cannot: the step reported a NaN loss without a word (the target left out of the
gradient, so the parameters stayed finite), and a GPT token id >= the vocabulary turned the parameters NaN, one below
0 read another token's row (a QA finding). Targets already on a device (Rows of jax.Arrays, which put_batch passes
through) are not read: the loss is still NaN."""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar

TX = optax.sgd(0.1)
C = 10


def make_model():
    return nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, C, rngs=nnx.Rngs(1)))


STRATEGIES = {
    "single": lambda m, loss: jaxpar.SingleDevice(m, TX, loss_fn=loss),
    "ddp": lambda m, loss: jaxpar.DistributedDataParallel(m, TX, loss_fn=loss, mesh=jaxpar.make_mesh(2)),
}


def batch(y, mask=None):
    out = {"x": np.ones((len(y), 4), np.float32), "y": np.asarray(y, np.int32)}
    if mask is not None:
        out["mask"] = np.asarray(mask, np.float32)
    return out


def finite(tree) -> bool:
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_an_out_of_range_class_target_is_refused_before_any_work(name, smoothing):
    loss = None if not smoothing else jaxpar.OutputLoss(functools.partial(jaxpar.cross_entropy,
                                                                          label_smoothing=smoothing))
    model = make_model()
    strategy = STRATEGIES[name](model, loss)
    placed = strategy.init(jaxpar.init_state(model, TX))
    for bad, at in ((C, 2), (-1, 1)):
        y = [0, 1, 2, 3]
        y[at] = bad
        grow = f", or give the model {C + 1} outputs" if bad == C else ""
        match = (f"^batch\\['y'\\] holds class target {bad} at \\({at},\\), outside \\[0, {C}\\) for the model's {C} "
                 f"outputs: cross_entropy would report the loss NaN and leave the target out of the gradient, not "
                 f"of the weight \\(torch's CrossEntropyLoss raises 'Target {bad} is out of bounds'\\); give class ids 0..{C - 1}, skip a "
                 f"target with ignore_index=-100 or batch\\['mask'\\] 0{grow}\\.$")
        with pytest.raises(ValueError, match=match):
            strategy.put_batch(batch(y))
        with pytest.raises(ValueError, match=match):  # evaluation's batches too
            jaxpar.evaluate(strategy, placed, [batch(y)])
    # not counted, so taken: ignore_index, a masked-out bad target (mask 0), and a bad target in both
    for ok in (batch([0, -100, 2, 3]), batch([0, C, -7, 3], mask=[1, 0, 0, 1]), batch([-100, 99, 2, 3], [1, 0, 1, 1])):
        placed, metrics = strategy.step(placed, strategy.put_batch(ok))
        assert np.isfinite(float(metrics["loss"])) and finite(strategy.unplace(placed).params)
    # the check runs on every batch, not once per shape: the same shape with a bad target is refused again
    with pytest.raises(ValueError, match="holds class target 10 at \\(0,\\), and 1 more"):
        strategy.put_batch(batch([C, C, 1, 2]))
    placed, _ = strategy.step(placed, strategy.put_batch(batch([0, 1, 2, 3])))  # the state was never consumed
    assert finite(strategy.unplace(placed).params)


def test_a_custom_key_and_ignore_index_are_respected():
    loss = jaxpar.OutputLoss(functools.partial(jaxpar.cross_entropy, key="labels", ignore_index=-1))
    model = make_model()
    strategy = jaxpar.SingleDevice(model, TX, loss_fn=loss)
    strategy.init(jaxpar.init_state(model, TX))
    strategy.put_batch({"x": np.ones((2, 4), np.float32), "labels": np.array([-1, 3], np.int32)})  # -1: ignored
    with pytest.raises(ValueError, match="^batch\\['labels'\\] holds class target -100 at \\(0,\\).*"
                                         "ignore_index=-1 or"):
        strategy.put_batch({"x": np.ones((2, 4), np.float32), "labels": np.array([-100, 3], np.int32)})
    strategy = jaxpar.SingleDevice(model, TX)  # the default loss on a tuple batch (x, y)
    strategy.init(jaxpar.init_state(model, TX))
    with pytest.raises(ValueError, match="^batch\\[1\\] holds class target 12 at \\(1,\\)"):
        strategy.put_batch((np.ones((2, 4), np.float32), np.array([3, 12], np.int32)))


def test_targets_already_on_a_device_are_not_read_and_still_give_a_nan_loss():
    """Rows of jax.Arrays pass through put_batch as they are: reading them would sync the device every step, so
    the check leaves them, and the step reports a NaN loss, as before (documented); the bad target is left out of
    the gradient, so the parameters stay finite (a GPT token id past the vocabulary turns them NaN)."""
    model = make_model()
    strategy = jaxpar.SingleDevice(model, TX)
    placed = strategy.init(jaxpar.init_state(model, TX))
    host = batch([0, C, 2, 3])
    rows = jaxpar.as_rows({k: jax.device_put(v) for k, v in host.items()})  # as_rows copies these to the host
    with pytest.raises(ValueError, match="holds class target 10"):
        strategy.put_batch(rows)
    on_device = jaxpar.Rows(jax.device_put(host), jax.device_put(rows.mask), jax.device_put(rows.ids))
    placed, metrics = strategy.step(placed, strategy.put_batch(on_device))
    assert np.isnan(float(metrics["loss"])) and finite(strategy.unplace(placed).params)


def test_a_gpt_token_id_outside_the_vocabulary_is_refused():
    cfg = jaxpar.GPTConfig.named("gpt-nano", vocab_size=16, block_size=8)
    model = jaxpar.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0))
    strategy = jaxpar.SingleDevice(model, TX)
    placed = strategy.init(jaxpar.init_state(model, TX))
    x = np.zeros((2, 8), np.int32)
    y = np.ones((2, 8), np.int32)
    for bad in (16, -1):
        x[1, 5] = bad
        with pytest.raises(ValueError, match=f"^batch\\['x'\\] holds token id {bad} at \\(1, 5\\), outside the "
                                             "vocabulary \\[0, 16\\) of the model's wte/embedding.*give token ids "
                                             "0..15"):
            strategy.put_batch({"x": x, "y": y})
    x[1, 5] = 3
    y[0, 2] = 16
    with pytest.raises(ValueError, match="^batch\\['y'\\] holds class target 16 at \\(0, 2\\), outside \\[0, 16\\)"):
        strategy.put_batch({"x": x, "y": y})
    y[0, 2] = -100
    placed, metrics = strategy.step(placed, strategy.put_batch({"x": x, "y": y}))
    assert np.isfinite(float(metrics["loss"]))


def test_the_pipeline_and_tensor_parallelism_refuse_them_too():
    """The check sits in the input check every strategy's put_batch runs: the pipeline (its own stages' put_batch)
    and tensor parallelism (GPT's logits split by vocabulary in the step; the loss traced whole by the check) refuse
    a class target and a token id as one device does, before anything is compiled."""
    from jax.sharding import Mesh

    model = make_model()
    pipe = jaxpar.Pipeline(model, TX, num_stages=2, micro_batches=2, mesh=jaxpar.make_mesh(2, pipe=2))
    pipe.init(jaxpar.init_state(model, TX))
    pipe.put_batch(batch([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="^batch\\['y'\\] holds class target 10 at \\(3,\\), outside \\[0, 10\\)"):
        pipe.put_batch(batch([0, 1, 2, C]))
    cfg = jaxpar.GPTConfig.named("gpt-nano", vocab_size=16, block_size=8, n_head=2)
    gpt = jaxpar.GPT(cfg, rngs=nnx.Rngs(params=0, dropout=0))
    tp = jaxpar.TensorParallel(gpt, TX, tensor_parallel=2,
                               mesh=Mesh(np.array(jax.devices()[:2]).reshape(1, 2), (jaxpar.DATA, jaxpar.TENSOR)))
    tp.init(jaxpar.init_state(gpt, TX))
    x, y = np.zeros((2, 8), np.int32), np.ones((2, 8), np.int32)
    tp.put_batch({"x": x, "y": y})
    with pytest.raises(ValueError, match="^batch\\['y'\\] holds class target 16 at \\(1, 7\\), outside \\[0, 16\\)"):
        tp.put_batch({"x": x, "y": np.where((np.arange(2)[:, None] == 1) & (np.arange(8) == 7), 16, y)})
    x[0, 1] = -1
    with pytest.raises(ValueError, match="^batch\\['x'\\] holds token id -1 at \\(0, 1\\), outside the vocabulary "
                                         "\\[0, 16\\) of the model's wte/embedding"):
        tp.put_batch({"x": x, "y": y})


@pytest.mark.parametrize("loss", [jaxpar.cross_entropy, functools.partial(jaxpar.cross_entropy, label_smoothing=0.1)],
                         ids=["cross_entropy", "partial"])
def test_a_pipeline_modules_own_cross_entropy_refuses_them_too(loss):
    """DeepSpeed's way, the loss in the module: PipelineModule(..., loss_fn=jaxpar.cross_entropy). The pipeline
    wraps such a loss (to name a DeepSpeed-style (outputs, labels) loss when it fails), and the wrapper hid
    cross_entropy from the check: a target of 10 trained silently with a NaN loss and a zero gradient norm (a QA
    finding), where OutputLoss(jaxpar.cross_entropy) given to the Pipeline was refused."""
    module = jaxpar.PipelineModule([jaxpar.LayerSpec(nnx.Linear, 4, 16), nnx.relu, jaxpar.LayerSpec(nnx.Linear, 16, C)],
                                   2, loss_fn=loss, partition_method="uniform")
    pipe = jaxpar.Pipeline(module, TX, micro_batches=2, mesh=jaxpar.make_mesh(2, pipe=2))
    pipe.init(jaxpar.init_state(module.model, TX))
    pipe.put_batch(batch([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="^batch\\['y'\\] holds class target 10 at \\(3,\\), outside \\[0, 10\\)"):
        pipe.put_batch(batch([0, 1, 2, C]))


class TinyLM(nnx.Module):
    """A user's own language model: its table read by nnx.Embed, by `table[ids]`, a token at a time in a lax.scan,
    by jnp.take(mode='clip') (the user's choice to clamp), at ids it computes (ids % rows), or at the first 4
    positions only."""

    def __init__(self, how: str, rows: int = 11):
        self.how, self.rows = how, rows
        self.emb = nnx.Embed(rows, 4, rngs=nnx.Rngs(0))
        self.out = nnx.Linear(4, rows, rngs=nnx.Rngs(1))

    def __call__(self, x):
        table = self.emb.embedding[...]
        jnp = jax.numpy
        h = {"embed": lambda: self.emb(x), "index": lambda: table[x],
             "scan": lambda: jnp.moveaxis(jax.lax.scan(lambda c, ids: (c, jnp.take(table, ids, axis=0)), 0,
                                                       jnp.moveaxis(x, -1, 0))[1], 0, -2),  # a token at a time
             "clip": lambda: jnp.take(table, x, axis=0, mode="clip"),
             "mod": lambda: self.emb(x % self.rows),
             "slice": lambda: jnp.concatenate([self.emb(x[..., :4]), jnp.zeros(x[..., 4:].shape + (4,))], -2),
             }[self.how]()
        return self.out(h)


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_a_users_embedding_refuses_ids_outside_its_table_wherever_the_lookup_reads_them_as_given(name):
    """Any table the model looks a batch leaf up in, not only jaxpar.GPT's: an id past an nnx.Embed's rows made
    jnp.take return NaN rows, and -1 read the last row without a word; `table[ids]` clamped. torch's nn.Embedding
    raises 'index out of range in self'. Found in the loss's trace (a gather of a model leaf at the batch leaf's own
    values, inside a lax.scan too; a frozen table as well), checked on the host like the class targets; the fix names
    a table holding the batch's largest id. A lookup the user clamps (mode='clip'), at ids the model computes, or of
    positions other than the bad one is left alone, and trains."""
    y = np.zeros((2, 8), np.int32)
    for how in ("embed", "index", "scan", "clip", "mod", "slice"):
        model = TinyLM(how)
        strategy = STRATEGIES[name](model, jaxpar.OutputLoss(jaxpar.cross_entropy))
        placed = strategy.init(jaxpar.init_state(model, TX))
        x = np.arange(16, dtype=np.int32).reshape(2, 8) % 11
        placed, metrics = strategy.step(placed, strategy.put_batch({"x": x, "y": y}))  # ids 0..10: trains
        assert np.isfinite(float(metrics["loss"]))
        for bad in (11, -1, 40):
            x[1, 5], x[1, 6] = bad, 40 if bad == 11 else 6  # with 11, a larger one after it: the table must hold 40
            if how in ("embed", "index", "scan"):
                more = ", and 1 more" if bad == 11 else ""
                fix = ", or build the model with a table of 41 rows or more" if bad >= 11 else "\\.$"
                want = (f"^batch\\['x'\\] holds token id {bad} at \\(1, 5\\){more}, outside the vocabulary "
                        "\\[0, 11\\) of the model's emb/embedding.*index out of range in self'\\); give token ids "
                        f"0..10{fix}")
                with pytest.raises(ValueError, match=want):
                    strategy.put_batch({"x": x, "y": y})
            else:  # clamped by the user's own choice, a computed id, or a position the lookup does not read: trains
                placed, metrics = strategy.step(placed, strategy.put_batch({"x": x, "y": y}))
                assert np.isfinite(float(metrics["loss"])), how
            x[1, 5], x[1, 6] = 3, 6
    frozen = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("emb")))  # a fine-tune with the table frozen: still a lookup
    model = TinyLM("embed")
    strategy = jaxpar.SingleDevice(model, TX, loss_fn=jaxpar.OutputLoss(jaxpar.cross_entropy), wrt=frozen)
    strategy.init(jaxpar.init_state(model, TX, frozen))
    x[1, 5] = 11
    with pytest.raises(ValueError, match="token id 11 at \\(1, 5\\), outside the vocabulary \\[0, 11\\) of the model's "
                                         "emb/embedding"):
        strategy.put_batch({"x": x, "y": y})
