"""jaxpar.data.datasets and jaxpar.data.idx: synthetic data, IDX files, npz, tfds (offline), splits, preprocessing."""
import gzip
import io
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.data import datasets as data
from jaxpar.data.datasets import DataError, Dataset, load
from jaxpar.data.idx import read_idx, write_idx

SHARED_MNIST = Path(__file__).parents[2] / "shared/data/mnist"  # ../shared beside the checkout (never copied)
MNIST_RANGE = ((0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081)


# ---------------------------------------------------------------- synthetic


@pytest.mark.parametrize("model, shape, classes", [
    ("convnet", (28, 28, 1), 10), ("mlp", (784,), 10), ("linear", (5,), 2), ("alexnet", (64, 64, 3), 10)])
def test_synthetic_shapes(model, shape, classes):
    d = load("synthetic", "test[:300]", model=model)
    assert isinstance(d, Dataset) and len(d) == 300
    assert d.x.shape == (300, *shape) and d.x.dtype == np.float32
    assert d.y.shape == (300,) and d.y.dtype == np.int32 and d.num_classes == classes
    assert set(np.unique(d.y)) == set(range(classes))
    assert np.isfinite(d.x).all()


def test_synthetic_deterministic_and_disjoint_draws():
    a, b = load("synthetic", "test[:1000]"), load("synthetic", "test[:1000]")
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    other_seed = load("synthetic", "test[:1000]", seed=1)
    assert not np.array_equal(a.x, other_seed.x)
    train = load("synthetic", "train[:1000]")
    flat_a, flat_t = a.x.reshape(1000, -1), train.x.reshape(1000, -1)
    assert not (flat_a[:, None, :50] == flat_t[None, :, :50]).all(-1).any()  # no test image is a train image
    assert MNIST_RANGE[0] - 1e-5 <= a.x.min() and a.x.max() <= MNIST_RANGE[1] + 1e-5  # [0, 1] then normalised
    assert a.x.min() < MNIST_RANGE[0] + 1e-3 and a.x.max() > MNIST_RANGE[1] - 1e-3


def test_synthetic_slices_are_rows_of_the_whole_split():
    whole = load("synthetic", "test")
    assert len(whole) == 10000
    part = load("synthetic", "test[1500:2500]")  # crosses a generation chunk boundary
    assert np.array_equal(part.x, whole.x[1500:2500]) and np.array_equal(part.y, whole.y[1500:2500])
    pct = load("synthetic", "test[10%:20%]")
    assert np.array_equal(pct.y, whole.y[1000:2000])
    assert np.array_equal(load("synthetic", "test[:-1000]").y, whole.y[:9000])
    both = load("synthetic", "test[:100]+train[:100]")
    assert np.array_equal(both.y[:100], whole.y[:100]) and len(both) == 200


def test_a_plain_split_name_needs_no_tensorflow_datasets(monkeypatch, tmp_path):
    """The GPU image has no tensorflow-datasets: 'train' and 'test' read without it (its parser is for slices),
    the whole split, and an empty one is still refused."""
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorflow_datasets"] + ["tensorflow_datasets"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it (or of a submodule loaded before) now fails
    x = np.arange(24).reshape(6, 4)
    np.savez(tmp_path / "tok.npz", x=x, y=x + 1, x_test=x[:0], y_test=x[:0])
    whole = load("npz", "train", data_path=str(tmp_path / "tok.npz"), model=None)
    assert np.array_equal(whole.x, x) and np.array_equal(whole.y, x + 1)
    with pytest.raises(ImportError):  # the check can fail: a slice still goes through tfds
        load("npz", "train[:2]", data_path=str(tmp_path / "tok.npz"), model=None)
    with pytest.raises(DataError, match="x_test has shape \\(0, 4\\), no rows; write the file with at least one"):
        load("npz", "test", data_path=str(tmp_path / "tok.npz"), model=None)


def test_synthetic_not_trivial_but_has_class_structure():
    """Cheap proxies (the >= 90% ConvNet check is a CLI run): a nearest-class-mean classifier on raw pixels
    is far above chance yet far from perfect, and no single pixel predicts the class."""
    tr, te = load("synthetic", "train[:10000]", model="mlp"), load("synthetic", "test[:2000]", model="mlp")
    means = np.stack([tr.x[tr.y == k].mean(0) for k in range(10)])
    dist = (te.x ** 2).sum(1)[:, None] - 2 * te.x @ means.T + (means ** 2).sum(1)[None]
    ncm = (dist.argmin(1) == te.y).mean()
    assert 0.3 < ncm < 0.9, ncm
    # best single pixel: each pixel quantised to 8 levels, majority class per level, scored on the test rows
    levels = lambda x: np.clip(((x * 0.3081 + 0.1307) * 8).astype(np.int64), 0, 7)  # noqa: E731
    p = np.arange(784)
    counts = np.bincount((p * 80 + levels(tr.x) * 10 + tr.y[:, None]).ravel(), minlength=784 * 80)
    majority = counts.reshape(784, 8, 10).argmax(-1)
    pixel_acc = (majority[p, levels(te.x)] == te.y[:, None]).mean(0)
    assert pixel_acc.max() < 0.3, pixel_acc.max()


def test_synthetic_linear_is_learnable_by_a_linear_model():
    tr, te = load("synthetic", "train[:5000]", model="linear"), load("synthetic", "test[:2000]", model="linear")
    w, *_ = np.linalg.lstsq(np.c_[tr.x, np.ones(len(tr))], np.eye(2)[tr.y], rcond=None)
    acc = ((np.c_[te.x, np.ones(len(te))] @ w).argmax(1) == te.y).mean()
    assert 0.8 < acc < 1.0, acc


# ---------------------------------------------------------------- preprocessing


def test_resize_matches_jax_image_resize():
    x = np.random.default_rng(0).random((5, 7, 9, 3), dtype=np.float32)
    for size in (16, 4):  # up and (antialiased) down
        want = jax.image.resize(jnp.asarray(x), (5, size, size, 3), "linear")
        np.testing.assert_allclose(data.resize(x, size), np.asarray(want), atol=1e-6)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="synthetic.*mnist.*cifar10.*npz"):
        load("imagenet")
    with pytest.raises(ValueError, match="convnet"):
        load("synthetic", model="resnet")
    assert data.DATASETS[:4] == ("synthetic", "mnist", "cifar10", "npz")


@pytest.mark.parametrize("split, match", [
    ("val", "'train', 'test'"), ("test[:20000]", "incompatible"), ("test[", "tfds syntax"),
    ("test[5:5]", "no samples")])
def test_bad_splits(split, match):
    with pytest.raises(DataError, match=match):
        load("synthetic", split)


# ---------------------------------------------------------------- IDX files


def _write_mnist(folder, n=50, split="test", gz=True, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    prefix = "t10k" if split == "test" else "train"
    ext = ".gz" if gz else ""
    write_idx(folder / f"{prefix}-images-idx3-ubyte{ext}", images)
    write_idx(folder / f"{prefix}-labels-idx1-ubyte{ext}", labels)
    return images, labels


@pytest.mark.parametrize("gz", [True, False])
def test_idx_folder_roundtrip(tmp_path, gz):
    images, labels = _write_mnist(tmp_path, gz=gz)
    assert np.array_equal(read_idx(tmp_path / f"t10k-images-idx3-ubyte{'.gz' * gz}"), images)
    d = load("mnist", "test[10:40]", data_dir=str(tmp_path))
    assert d.x.shape == (30, 28, 28, 1) and np.array_equal(d.y, labels[10:40])
    np.testing.assert_allclose(d.x[..., 0], (images[10:40] / 255 - 0.1307) / 0.3081, rtol=1e-5, atol=1e-6)
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*train-labels-idx1-ubyte"):
        load("mnist", "train", data_dir=str(tmp_path))  # absent split: the error names its files


def test_idx_reader_rejects_bad_files(tmp_path):
    _write_mnist(tmp_path, gz=False)
    good = (tmp_path / "t10k-images-idx3-ubyte").read_bytes()
    cases = {
        "truncated": (good[:-100], "truncated"),
        "extra": (good + b"\0", "extra bytes"),
        "magic": (b"\x01\x02" + good[2:], "magic number 0x0102"),
        "short": (good[:2], "truncated"),
        "header": (good[:9], "16-byte header"),
    }
    for name, (payload, match) in cases.items():
        path = tmp_path / f"{name}-idx3-ubyte"
        path.write_bytes(payload)
        with pytest.raises(DataError, match=match) as e:
            read_idx(path)
        assert str(path) in str(e.value) and "re-download" in str(e.value)
    with pytest.raises(DataError, match="1 dimensions, expected 3"):
        read_idx(tmp_path / "t10k-labels-idx1-ubyte", ndim=3)
    broken_gz = tmp_path / "broken-idx3-ubyte.gz"
    broken_gz.write_bytes(gzip.compress(good)[:-50])
    with pytest.raises(DataError, match="gzip") as e:
        read_idx(broken_gz)
    assert str(broken_gz) in str(e.value)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(49, np.uint8))  # 50 images, 49 labels
    with pytest.raises(DataError, match="50 images but .* 49 labels"):
        load("mnist", "test", data_dir=str(tmp_path))


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason=f"{SHARED_MNIST} (real MNIST t10k) is not beside this checkout")
def test_real_mnist_t10k():
    d = load("mnist", "test", data_dir=str(SHARED_MNIST))
    assert d.x.shape == (10000, 28, 28, 1) and d.num_classes == 10
    counts = np.bincount(d.y, minlength=10)
    assert counts.sum() == 10000 and counts.min() > 800 and d.y[0] == 7
    assert abs(d.x.mean()) < 0.05 and abs(d.x.std() - 1) < 0.05  # MNIST's own mean/std
    head, tail = load("mnist", "test[:8000]", data_dir=str(SHARED_MNIST)), load(
        "mnist", "test[8000:]", data_dir=str(SHARED_MNIST))
    assert len(head) == 8000 and len(tail) == 2000 and np.array_equal(tail.x, d.x[8000:])
    alex = load("mnist", "test[:4]", data_dir=str(SHARED_MNIST), model="alexnet")
    assert alex.x.shape == (4, 64, 64, 3)  # resized to 64, the gray channel replicated
    raw = alex.x * np.float32(data.IMAGENET_STD) + np.float32(data.IMAGENET_MEAN)
    np.testing.assert_allclose(raw[..., 0], raw[..., 2], atol=1e-5)


# ---------------------------------------------------------------- npz


def test_npz(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8), rng.integers(0, 3, 40)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y, x_test=x[:10], y_test=y[:10])
    d = load("npz", "train[:-5]", data_path=str(path))
    assert d.x.shape == (35, 28, 28, 1) and d.num_classes == 3 and np.array_equal(d.y, y[:35])
    np.testing.assert_allclose(d.x[..., 0], (x[:35] / 255 - 0.1307) / 0.3081, rtol=1e-5, atol=1e-6)
    assert len(load("npz", "test", data_path=str(path))) == 10
    vec = tmp_path / "v.npz"
    np.savez(vec, x=rng.standard_normal((20, 7)).astype(np.float32), y=np.arange(20) % 2)
    v = load("npz", "train", data_path=str(vec), model="mlp")
    assert v.x.shape == (20, 7) and v.num_classes == 2  # float data is taken as already normalised
    with pytest.raises(DataError, match="splits are \\['train'\\]"):
        load("npz", "test", data_path=str(vec))
    with pytest.raises(DataError, match="takes images"):
        load("npz", "train", data_path=str(vec), model="convnet")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=x, y=y[:39])
    with pytest.raises(DataError, match=r"y has shape \(39,\).*\[40, \.\.\.\]"):
        load("npz", data_path=str(bad))
    np.savez(bad, x=x)
    with pytest.raises(DataError, match="needs 'x' and 'y'"):
        load("npz", data_path=str(bad))
    with pytest.raises(DataError, match="--data-path"):
        load("npz")


def test_npz_takes_any_targets_tokens_and_extra_arrays(tmp_path):
    """A user's model (model=None): float targets, integer token arrays, and per-row extras such as a mask."""
    rng = np.random.default_rng(1)
    reg = tmp_path / "reg.npz"
    np.savez(reg, x=rng.standard_normal((12, 4)).astype(np.float32), y=rng.standard_normal((12, 2)))
    d = load("npz", "train", data_path=str(reg), model=None)
    assert d.num_classes is None and d.y.shape == (12, 2) and d.y.dtype == np.float64
    with pytest.raises(DataError, match="needs integer labels"):
        load("npz", "train", data_path=str(reg), model="mlp")  # a built-in classifier cannot take them
    tok = tmp_path / "tok.npz"
    x, mask = rng.integers(0, 50, (10, 8)).astype(np.int32), (rng.random((10, 8)) > 0.2).astype(np.float32)
    np.savez(tok, x=x, y=np.roll(x, -1, 1), mask=mask, x_test=x[:3], y_test=x[:3], mask_test=mask[:3])
    t = load("npz", "train[2:]", data_path=str(tok), model=None)
    assert t.x.dtype == np.int32 and np.array_equal(t.x, x[2:]) and t.num_classes is None
    b = t.batch(np.array([0, 3]))
    assert sorted(b) == ["mask", "x", "y"] and np.array_equal(b["mask"], mask[[2, 5]])
    assert len(load("npz", "test", data_path=str(tok), model=None)) == 3
    np.savez(tok, x=x, y=np.arange(10) % 3)  # token inputs with class labels: still no food for a built-in
    with pytest.raises(DataError, match="takes float"):
        load("npz", "train", data_path=str(tok), model="mlp")
    np.savez(tok, x=x, y=x, mask=mask[:9])
    with pytest.raises(DataError, match="extra array 'mask' needs 'mask'"):
        load("npz", "train", data_path=str(tok), model=None)


def test_three_channel_images_need_alexnet(tmp_path):
    path = tmp_path / "c.npz"
    np.savez(path, x=np.zeros((4, 32, 32, 3), np.uint8), y=np.arange(4))
    with pytest.raises(DataError, match="--model alexnet"):
        load("npz", data_path=str(path), model="convnet")
    d = load("npz", data_path=str(path), model="alexnet", image_size=40)
    assert d.x.shape == (4, 40, 40, 3)
    np.testing.assert_allclose(d.x[0, 0, 0], -np.float32(data.IMAGENET_MEAN) / np.float32(data.IMAGENET_STD))


# ---------------------------------------------------------------- tfds (no TensorFlow, no internet)


class _Source:
    """A random-access source as tfds.data_source returns: len() and [i] -> {"image", "label"}."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"image": self.images[i], "label": np.int64(self.labels[i])}


def test_tfds_data_source_under_mock_data():
    import tensorflow_datasets as tfds

    images = np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    splits = []

    def as_data_source(builder, split, **kwargs):
        splits.append((builder.name, split))
        return _Source(images, np.arange(6) % 10)

    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_data_source_fn=as_data_source):
        d = load("cifar10", "train[:6]", model="alexnet")
    assert splits == [("cifar10", "train[:6]")]  # the split string goes to tfds as is
    assert d.x.shape == (6, 64, 64, 3) and np.array_equal(d.y, np.arange(6))
    mean, std = np.float32(data.IMAGENET_MEAN), np.float32(data.IMAGENET_STD)
    np.testing.assert_allclose(d.x * std + mean, data.resize(images / 255, 64), atol=1e-5)


def test_tfds_under_the_default_mock_data():
    """tfds.testing.mock_data() as a user would first write it (random examples from the dataset's own metadata):
    its data source's __getitems__ takes other arguments than a real one's (a review: a TypeError deep in tfds), so
    the reads fall back to one example at a time."""
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12):
        d = load("mnist", "train[:12]", model="mlp")
    assert d.x.shape[0] == 12 and d.y.shape == (12,) and set(np.unique(d.y)) <= set(range(10))
    assert np.std(d.x) > 0  # real (random) pixels, normalised


def test_tfds_reads_prepared_array_record(tmp_path):
    """A real ArrayRecord mnist prepared here (a builder with made-up examples, PNG-encoded with PIL):
    tfds.data_source reads and decodes it without TensorFlow."""
    import tensorflow_datasets as tfds
    from PIL import Image

    def png(label):
        buf = io.BytesIO()
        Image.fromarray(np.full((28, 28), label * 25, np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    class FakeMnist(tfds.builder_cls("mnist"), skip_registration=True):
        name = "mnist"

        def _split_generators(self, dl_manager):
            return {s: ((i, {"image": png(i % 10), "label": i % 10}) for i in range(n))
                    for s, n in (("train", 30), ("test", 12))}

    FakeMnist(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    d = load("mnist", "test[2:9]", data_dir=str(tmp_path))
    assert d.x.shape == (7, 28, 28, 1) and len(load("mnist", "train", data_dir=str(tmp_path))) == 30
    raw = np.rint((d.x * 0.3081 + 0.1307) * 255)
    assert np.array_equal(raw[:, 5, 5, 0], d.y * 25)  # each decoded image matches its label
    with pytest.raises(DataError, match="split 'validation'.*'train', 'test'"):
        load("mnist", "validation", data_dir=str(tmp_path))
    # empty and reversed slices: the one line the other sources give, before tfds reads (tfds said "Paths sequence
    # can not be of 0 length", or failed in len() with a traceback: a QA finding)
    for spec in ("test[10:5]", "train[90%:10%]", "train[:0]", "test[:-12]"):
        with pytest.raises(DataError, match=rf"split '{re.escape(spec)}' selects no samples; choose a non-empty"):
            load("mnist", spec, data_dir=str(tmp_path))


def test_npz_num_classes_and_labels_are_checked(tmp_path):
    """num_classes must be one integer (a 2-D array failed in int(), a float was cut), and labels must fit the
    devices' int32 (2**32 + 1 was loaded as 1: a QA finding)."""
    x = np.zeros((4, 3), np.float32)
    for value in (np.array([[3]]), np.float64(2.7), np.int64(0)):
        np.savez(tmp_path / "a.npz", x=x, y=np.zeros(4, np.int64), num_classes=value)
        with pytest.raises(DataError, match=r"num_classes is .*store it as one integer >= 1"):
            load("npz", "train", data_path=str(tmp_path / "a.npz"), model="mlp")
    np.savez(tmp_path / "b.npz", x=x, y=np.array([0, 1, 2 ** 32 + 1, 0], np.int64))
    with pytest.raises(DataError, match="labels up to 4294967297 do not fit int32"):
        load("npz", "train", data_path=str(tmp_path / "b.npz"), model="mlp")
    np.savez(tmp_path / "c.npz", x=x, y=np.array([0, 1, 2, 0], np.int64), num_classes=np.int64(5))
    assert load("npz", "train", data_path=str(tmp_path / "c.npz"), model="mlp").num_classes == 5


def test_tfds_unprepared_offline_error(tmp_path):
    """Not prepared, and tfds cannot download and prepare here (no internet, no TensorFlow)."""
    with pytest.raises(DataError) as e:
        load("mnist", "train", data_dir=str(tmp_path))
    for hint in ("not prepared", "--data-dir", "TFDS_DATA_DIR", "--dataset synthetic", "IDX"):
        assert hint in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(DataError, match="not a folder"):
        load("cifar10", data_dir=str(tmp_path / "missing"))


def test_uint8_token_sequences_stay_integers(tmp_path):
    """Byte tokens stored as uint8 [N, T] were read as float32 vectors: a GPT then refused the file as "not integer",
    and a user's nnx.Embed failed in flax. uint8 images still become normalised float32."""
    from jaxpar.config import Config
    from jaxpar.run import trainer

    t = np.random.default_rng(0).integers(0, 200, (4, 17))
    np.savez(tmp_path / "tok8.npz", x=t[:, :-1].astype(np.uint8), y=t[:, 1:].astype(np.uint8))
    data = load("npz", "train", data_path=str(tmp_path / "tok8.npz"), model=None)
    assert data.x.dtype == np.uint8 and np.array_equal(data.x, t[:, :-1])
    model = trainer.gpt_model(Config(model="gpt-nano", dataset="npz"), data)
    assert model.config.vocab_size == int(t.max()) + 1 and model.config.block_size == 16
    np.savez(tmp_path / "img8.npz", x=np.full((4, 8, 8), 255, np.uint8), y=np.arange(4))
    images = load("npz", "train", data_path=str(tmp_path / "img8.npz"), model=None)
    assert images.x.dtype == np.float32 and images.x.shape == (4, 8, 8, 1)


def test_uint8_images_are_normalised_with_torchs_constants(tmp_path):
    """uint8 images become (x / 255 - mean) / std with the constants the torch recipes use, written out here rather
    than read from the module: MNIST's 0.1307 / 0.3081 (pytorch/examples' mnist) and ImageNet's per RGB channel
    (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225) (torchvision's models): a white pixel, channel by channel."""
    path = tmp_path / "w.npz"
    np.savez(path, x=np.full((2, 28, 28), 255, np.uint8), y=np.arange(2))
    np.testing.assert_allclose(load("npz", data_path=str(path), model="convnet").x[0, 0, 0], [(1 - 0.1307) / 0.3081],
                               rtol=1e-6)
    np.savez(path, x=np.full((2, 40, 40, 3), 255, np.uint8), y=np.arange(2))
    white = load("npz", data_path=str(path), model="alexnet", image_size=40).x[0, 0, 0]
    np.testing.assert_allclose(white, (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225]),
                               rtol=1e-6)


def test_idx_files_of_wider_types_read_in_native_byte_order(tmp_path):
    """IDX stores values big-endian; read_idx gives them in the machine's own order (what numpy, jax and torch
    expect of an array's bytes), for every type the format has, not only MNIST's uint8."""
    for dtype in (np.int16, np.int32, np.float32, np.float64):
        want = (np.arange(12) - 5).astype(dtype).reshape(3, 4) * 3
        write_idx(tmp_path / "a.idx", want)
        got = read_idx(tmp_path / "a.idx")
        assert got.dtype == np.dtype(dtype) and got.dtype.isnative, got.dtype.str
        np.testing.assert_array_equal(got, want)
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("write, message", [
    (lambda p: np.save(p, np.zeros((3, 4))), "is not an .npz .* it is a .npy array, which names no x and y"),
    (lambda p: open(p, "w").write("a,b\n1,2\n"), "is not an .npz .* it starts b'a,b"),
])
def test_npz_path_to_another_format_is_one_line(tmp_path, write, message):
    """--data-path to a .npy (np.load returns an array: a TypeError traceback from `with`) or a CSV (np.load's
    pickle error, suggesting allow_pickle) is refused in one line naming the file, the format and np.savez."""
    path = tmp_path / "data.npz"
    write(tmp_path / "data")  # np.save appends .npy
    (tmp_path / ("data.npy" if (tmp_path / "data.npy").exists() else "data")).rename(path)
    path = str(path)
    with pytest.raises(DataError, match=message) as e:
        load("npz", "train", data_path=path, model="linear")
    assert path in str(e.value) and "np.savez" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["synthetic", "text"])
def test_negative_seed_is_refused_in_one_line(name):
    """jaxpar.load(..., seed=-1) said numpy's bare "expected non-negative integer" from deep in SeedSequence."""
    with pytest.raises(ValueError, match=r"seed=-1 must be an integer >= 0.*pass e.g. seed=0") as e:
        load(name, "test[:5]", seed=-1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("shape, model", [((1, 28, 28), "convnet"), ((3, 32, 32), "alexnet"), ((1, 28, 28), "mlp")])
def test_channels_first_images_are_named(tmp_path, dtype, shape, model):
    """PyTorch's NCHW images in an npz: uint8 ones were refused as having "28 channels" with the advice to store
    float32 instead, and float32 ones went to AlexNet as 64x64 images of 28 or 32 channels (H resized from 1 or 3).
    Now one line names the layout and the transpose. (mlp on float NCHW: a flat vector either way, accepted.)"""
    path = str(tmp_path / "nchw.npz")
    np.savez(path, x=np.zeros((4, *shape), dtype), y=np.arange(4))
    if model == "mlp" and dtype == np.float32:
        assert load("npz", "train", data_path=path, model=model).x.shape == (4, int(np.prod(shape)))
        return
    with pytest.raises(DataError, match=r"channels first .*PyTorch's layout.*x\.transpose\(0, 2, 3, 1\)") as e:
        load("npz", "train", data_path=path, model=model)
    assert "\n" not in str(e.value)
