"""Sampling from a GPT (jaxpar.models.gpt_generate): the one-program loop equals nanoGPT's generate written out
step by step (the context cropped to block_size), greedy and sampled, with the KV cache and without; the cached
forward's logits equal the whole context's at every position; top_k keeps the k largest logits; the draws follow
softmax(logits / temperature); bad arguments are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import gpt, gpt_generate
from test_gpt import scramble  # weights far from the init: peaked, distinct logits

CFG = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)


@pytest.fixture(scope="module")
def model():
    return scramble(gpt.GPT(CFG, rngs=nnx.Rngs(params=0, dropout=1)), seed=3)


@nnx.jit
def _logits(model, idx):
    return model(idx)


def last_logits(model, idx: np.ndarray) -> np.ndarray:
    """nanoGPT's step: the context cropped to the last block_size tokens, the logits at its last position (one
    compiled forward per context length: run eagerly, op by op, each new length cost seconds of compiles)."""
    evaluated = nnx.clone(model)
    evaluated.eval()
    return np.asarray(_logits(evaluated, jnp.asarray(idx[:, -CFG.block_size:])))[:, -1]


PROMPT = np.array([[1, 2, 3], [4, 4, 0]])


def test_greedy_equals_the_step_by_step_loop_across_the_block_size(model):
    out = model.generate(PROMPT, 9, temperature=0)  # 3 + 9 = 12 tokens: the last 4 steps see a cropped context
    idx = PROMPT.copy()
    for _ in range(9):
        idx = np.concatenate([idx, last_logits(model, idx).argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, idx)
    assert len(set(out[0, 3:].tolist())) > 1  # not one token repeated: the loop really moves on
    np.testing.assert_array_equal(model.generate(PROMPT, 9, temperature=0.7, top_k=1), out)  # top 1 is the argmax
    # a temperature float32 holds as 0 is greedy too (logits / 0 were inf - inf = NaN: token 0 every step)
    np.testing.assert_array_equal(model.generate(PROMPT, 9, temperature=1e-50), out)
    np.testing.assert_array_equal(model.generate(PROMPT, 9, temperature=1e-30, top_k=5), out)


def test_sampled_tokens_are_within_the_top_k_of_each_step_and_repeat_with_the_seed(model):
    out = model.generate(PROMPT, 9, temperature=1.5, top_k=3, seed=5)
    np.testing.assert_array_equal(model.generate(PROMPT, 9, temperature=1.5, top_k=3, seed=5), out)
    assert not np.array_equal(model.generate(PROMPT, 9, temperature=1.5, top_k=3, seed=6), out)
    for t in range(3, 12):  # each drawn token among the 3 largest logits of its own step's context
        top3 = np.argsort(last_logits(model, out[:, :t]), axis=-1)[:, -3:]
        assert all(out[b, t] in top3[b] for b in range(2)), t


@pytest.mark.parametrize("prompt_len, block_size, bias", [(3, 8, True), (130, 136, False)])
def test_the_cached_forward_equals_the_whole_context_at_every_position(prompt_len, block_size, bias):
    """The prefill (130 tokens: the CPU path's query blocks) and each one-token step after it, against the eval
    model on the whole context: the logits at the last position agree to 1e-5, and both sides move."""
    cfg = gpt.GPTConfig(vocab_size=16, block_size=block_size, n_layer=2, n_head=2, n_embd=16, bias=bias)
    m = scramble(gpt.GPT(cfg, rngs=nnx.Rngs(0)), seed=4)
    m.eval()
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, block_size)), jnp.int32)
    whole_BxTxV = np.asarray(m(idx))
    step = jax.jit(lambda tok, pos, cache: gpt_generate.forward_cached(m, tok, pos, cache, block_size))
    logits_BxV, cache = jax.jit(lambda tok: gpt_generate.forward_cached(m, tok, 0, None, block_size))(
        idx[:, :prompt_len])
    got = [np.asarray(logits_BxV)]
    for pos in range(prompt_len, block_size):
        logits_BxV, cache = step(idx[:, pos:pos + 1], pos, cache)
        got.append(np.asarray(logits_BxV))
    want = whole_BxTxV[:, prompt_len - 1:]
    assert np.abs(want[:, 1:] - want[:, :-1]).max() > 1.0  # the logits change along the sequence
    np.testing.assert_allclose(np.stack(got, axis=1), want, rtol=1e-5, atol=1e-5)
    # a chunk of 3 tokens after the prefill (each query sees the cache and the chunk up to itself), then one more
    _, cache = jax.jit(lambda tok: gpt_generate.forward_cached(m, tok, 0, None, block_size))(idx[:, :prompt_len])
    chunk_BxV, cache = jax.jit(lambda tok, cache: gpt_generate.forward_cached(m, tok, prompt_len, cache, block_size))(
        idx[:, prompt_len:prompt_len + 3], cache)
    next_BxV, _ = step(idx[:, prompt_len + 3:prompt_len + 4], prompt_len + 3, cache)
    np.testing.assert_allclose(np.asarray(chunk_BxV), whole_BxTxV[:, prompt_len + 2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(next_BxV), whole_BxTxV[:, prompt_len + 3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt, new", [(PROMPT, 9), (PROMPT, 4), (np.arange(10)[None] % 16, 3)])
def test_the_kv_cache_changes_no_token(model, prompt, new, monkeypatch):
    """Across the block size (3 + 9 > 8: cache, then window), within it (3 + 4: the cache alone, the whole-window
    forward never called) and from a prompt longer than it (no cache): the same tokens, greedy and sampled."""
    for kwargs in ({"temperature": 0}, {"temperature": 1.5, "top_k": 3, "seed": 2}):
        without = model.generate(prompt, new, kv_cache=False, **kwargs)
        if prompt.shape[1] + new <= CFG.block_size:
            def refuse(self, idx):
                raise AssertionError("the KV cache path ran the whole-window forward")
            monkeypatch.setattr(gpt.GPT, "__call__", refuse)
        np.testing.assert_array_equal(model.generate(prompt, new, **kwargs), without)
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_16_bit_weights_generate_with_and_without_the_cache(model, dtype):
    """A GPT whose weights are 16-bit (its embeddings follow their tables, so the whole model runs in 16 bits)
    samples with the KV cache as without it; float16 attention on CPUs runs in float32 (XLA:CPU refuses jax's
    float16 x float16 -> float32 products), which the cached path reached on its own."""
    graphdef, state = nnx.split(model)
    low = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                                           else a, state))
    cached, plain = (low.generate(PROMPT, 4, temperature=0, kv_cache=kv) for kv in (True, False))
    np.testing.assert_array_equal(cached, plain)
    assert cached.shape == (2, 7) and low(jnp.asarray(PROMPT)).dtype == dtype


def test_draws_follow_the_tempered_softmax(model):
    """4,000 one-token continuations of one prompt: the frequencies are softmax(logits / T) (3 sigma)."""
    n, temperature = 4000, 2.0
    prompt = np.repeat(PROMPT[:1], n, axis=0)
    drawn = model.generate(prompt, 1, temperature=temperature, seed=0)[:, -1]
    z = last_logits(model, PROMPT[:1])[0] / temperature
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    assert p.max() < 0.9 and (p > 0.02).sum() >= 3  # several tokens likely: a frequency test with teeth
    freq = np.bincount(drawn, minlength=CFG.vocab_size) / n
    np.testing.assert_array_less(np.abs(freq - p), 3 * np.sqrt(p * (1 - p) / n) + 1e-3)


def test_top_k_above_the_vocabulary_keeps_every_token_as_nanogpt(model):
    """nanoGPT's generate crops to min(top_k, vocab): sample.py's top_k=200 on its 65-character shakespeare_char
    model keeps all 65. generate(top_k=200) on a 16-token model draws what top_k=None draws (it was refused)."""
    want = model.generate(PROMPT, 9, temperature=1.5, top_k=None, seed=4)
    np.testing.assert_array_equal(model.generate(PROMPT, 9, temperature=1.5, top_k=200, seed=4), want)
    np.testing.assert_array_equal(model.generate(PROMPT, 9, temperature=1.5, top_k=np.int64(17), seed=4), want)


@pytest.mark.parametrize("args, kwargs, message", [
    ((np.array([1, 2]), 3), {}, r"shape \(2,\).*pass integer tokens \[B, T\]"),
    ((np.array([[1, 16]]), 3), {}, "token 16, outside the model's vocabulary 0..15"),
    ((np.zeros((0, 3), np.int64), 2), {}, r"shape \(0, 3\).*with B >= 1"),  # a ZeroDivisionError inside jax
    (([[1, 2, 3], [4, 5]], 2), {}, "the prompts have different lengths"),  # numpy's "inhomogeneous shape"
    ((PROMPT, -1), {}, "max_new_tokens=-1 must be an int >= 0"),
    ((PROMPT, 2), {"temperature": -0.5}, "temperature=-0.5 must be a finite number >= 0"),
    ((PROMPT, 2), {"temperature": float("inf")}, "temperature=inf must be a finite number >= 0"),
    ((PROMPT, 2), {"temperature": "0.8"}, "temperature='0.8' must be a finite number"),
    ((PROMPT, 2), {"seed": 1.5}, "seed=1.5 must be an int"),
    ((PROMPT, 2), {"top_k": 0}, r"top_k=0 must be an int >= 1"),
    ((PROMPT, 2), {"top_k": 2.5}, r"top_k=2.5 must be an int >= 1"),
    ((PROMPT, 2), {"top_k": True}, r"top_k=True must be an int >= 1"),
    ((PROMPT, 2), {"vocab_limit": 17}, r"vocab_limit=17 must be an int in 1..16"),
    ((PROMPT, 2), {"vocab_limit": 0}, r"vocab_limit=0 must be an int in 1..16"),
])
def test_bad_arguments_are_refused(model, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(*args, **kwargs)
    np.testing.assert_array_equal(model.generate(PROMPT, 0), PROMPT)  # nothing to add: the prompt back


def test_vocab_limit_draws_only_the_tokens_below_it(model):
    """generate(vocab_limit=8) on a 16-token model: greedy is the step-by-step loop's argmax over the first 8
    logits, sampling stays below 8, with and without the cache; unlimited, the same prompt draws tokens >= 8."""
    assert (model.generate(PROMPT, 9, temperature=0) >= 8).any()  # the check can fail: the limit changes tokens
    out = model.generate(PROMPT, 9, temperature=0, vocab_limit=8)
    idx = PROMPT.copy()
    for _ in range(9):
        idx = np.concatenate([idx, last_logits(model, idx)[:, :8].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, idx)
    for kv_cache in (True, False):
        drawn = model.generate(np.repeat(PROMPT, 50, axis=0), 9, temperature=1.5, top_k=12, seed=2,
                               kv_cache=kv_cache, vocab_limit=8)
        assert drawn[:, 3:].max() < 8 and len(np.unique(drawn[:, 3:])) > 3


def test_train_py_samples_bytes_from_a_model_with_a_larger_vocabulary():
    """--sample prints bytes: a GPT whose vocabulary is larger than the 256 bytes (GPT-2's weights by --init-torch,
    trained on --dataset text) draws only those (a QA finding: ids above 255 were printed as id % 256)."""
    import optax

    from jaxpar.config import Config
    from jaxpar.run import trainer
    from jaxpar.step import init_state

    from test_gpt import scramble

    big = scramble(gpt.GPT(gpt.GPTConfig(vocab_size=300, block_size=16, n_layer=2, n_head=2, n_embd=16),
                           rngs=nnx.Rngs(params=0, dropout=1)), seed=4)
    prompt = np.frombuffer(b"def ", np.uint8).astype(np.int32)[None]
    assert (big.generate(prompt, 24, temperature=0) >= 256).any()  # the check can fail
    cfg = Config(model="gpt-nano", dataset="text", sample=24, sample_temperature=0.0, sample_prompt="def ", seed=3)
    got = trainer.sample_text(cfg, big, init_state(big, optax.sgd(0.1)))
    want = big.generate(prompt, 24, temperature=0, vocab_limit=256)
    assert got == bytes(want[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def test_train_py_prints_a_sample_of_the_trained_model(tmp_path, capsys):
    """--sample N after training (ddp, 2 devices): the trained weights' continuation of --sample-prompt, printed and
    in the summary, the library's generate on the summary's state with the run's seed."""
    from jaxpar import cli

    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"".join(f"def f{i}(x):\n    return x + {i}\n\n".encode() for i in range(400)))
    summary = cli.main(["--model", "gpt-nano", "--dataset", "text", "--data-path", str(corpus), "--seq-len", "16",
                        "--batch-size", "8", "--steps", "2", "--eval-split", "", "--strategy", "ddp", "--num-devices",
                        "2", "--sample", "24", "--sample-prompt", "def ", "--seed", "3", "--quiet"])
    assert summary["sample"].startswith("def ") and summary["sample"] in capsys.readouterr().out
    trained = gpt.GPT(gpt.GPTConfig.named("gpt-nano", vocab_size=256, block_size=16), rngs=nnx.Rngs(0))
    nnx.update(trained, summary["state"].params)
    prompt = np.frombuffer(b"def ", np.uint8).astype(np.int32)[None]
    want = trained.generate(prompt, 24, temperature=0.8, top_k=200, seed=3)
    assert summary["sample"] == bytes(want[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")
