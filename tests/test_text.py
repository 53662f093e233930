"""The byte-level text dataset: windows, the split by position, the seed, the default corpus, bad input."""
from __future__ import annotations

import os

import numpy as np
import pytest

from jaxpar.data import datasets, text

CORPUS = bytes(range(256)) * 40 + b"the end\n"  # 10,248 bytes, every byte value present


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(CORPUS)
    return str(path)


def test_windows_are_the_corpus_and_y_is_x_shifted_by_one(corpus_file):
    data = np.frombuffer(CORPUS, np.uint8)
    train = text.load("train", corpus_file, seq_len=16, seed=3)
    batch = train.batch(np.arange(len(train)))
    assert batch["x"].shape == batch["y"].shape == (len(train), 16) and batch["x"].dtype == np.int32
    np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])
    for s, row in zip(train.starts, batch["x"]):
        np.testing.assert_array_equal(row, data[s:s + 16])
    assert batch["y"][np.argmax(train.starts)][-1] == data[train.starts.max() + 16]


def test_split_by_position_train_windows_stay_before_the_held_out_part(corpus_file):
    n_train = int(len(CORPUS) * (1 - text.HELD_OUT))
    train = text.load("train", corpus_file, seq_len=16)
    test = text.load("test", corpus_file, seq_len=16)
    assert len(train) == (n_train - 1) // 16 and len(test) == (len(CORPUS) - n_train - 1) // 16
    assert (train.starts + 16 < n_train).all() and train.starts.min() >= 0  # the targets too
    # over 200 seeds every start is drawn somewhere, the last one that keeps its targets in the training part too
    starts = np.concatenate([text.load("train", corpus_file, seq_len=16, seed=s).starts for s in range(200)])
    assert starts.min() == 0 and starts.max() == n_train - 17
    np.testing.assert_array_equal(test.starts, n_train + 16 * np.arange(len(test)))  # consecutive: each byte once
    assert test.starts[-1] + 16 < len(CORPUS)


def test_offsets_come_from_the_seed(corpus_file):
    a, b, c = (text.load("train", corpus_file, seq_len=8, seed=s).starts for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.9


@pytest.mark.parametrize("spec, window", [("test[:3]", slice(0, 3)), ("test[2:]", slice(2, None)),
                                          ("test[-2:]", slice(-2, None)), ("test[:50%]", slice(0, 32))])
def test_split_slices_select_windows(corpus_file, spec, window):
    whole = text.load(spec.split("[")[0], corpus_file, seq_len=8)
    assert len(whole) == 64
    part = text.load(spec, corpus_file, seq_len=8)
    np.testing.assert_array_equal(part.starts, whole.starts[window])


@pytest.mark.parametrize("a, b", [("train[:90%]", "train[90%:]"), ("train[10%:]", "train[:10%]"),
                                  ("train[:600]", "train[600:610]")])
def test_slices_of_train_are_slices_of_its_bytes(corpus_file, a, b):
    """Train windows sit at random offsets; a slice's are drawn inside its own bytes (windows lo..hi-1 start in
    [8 lo, 8 hi]), so a validation slice carved from 'train' predicts no byte that the other slice trains on. Drawn
    over the whole part, 71 % of a 10 % slice's targets were in the other's windows (a QA finding)."""
    part = {s: text.load(s, corpus_file, seq_len=8, seed=1) for s in (a, b)}
    span = lambda d, first: set((d.starts[:, None] + np.arange(first, 9)).ravel().tolist())  # noqa: E731
    cuts = {8 * x for s in (a, b) for x in text.parse_split(s, {"train": 1216})[1:]}  # the bytes between slices
    for one, other in ((a, b), (b, a)):
        assert not (span(part[one], 1) & span(part[other], 0)) - cuts  # one's targets among the other's bytes
    assert len(part[a]) + len(part[b]) == (1216 if b.endswith(":]") or a.endswith(":]") else 610)
    whole = text.load("train", corpus_file, seq_len=8, seed=1)  # the whole part: the draw it always was
    rng = np.random.default_rng([1, 0x7E47])
    n_train = int(len(CORPUS) * (1 - text.HELD_OUT))
    np.testing.assert_array_equal(whole.starts, rng.integers(0, n_train - 8, len(whole)))
    assert len(set(whole.starts.tolist()) & span(part[b], 0)) > 0  # the whole part's draw would have overlapped


def test_folder_is_its_files_concatenated_in_sorted_order(tmp_path):
    (tmp_path / "b.py").write_bytes(b"B" * 3000)
    (tmp_path / "a.py").write_bytes(b"A" * 3000)
    (tmp_path / "skip.bin").write_bytes(b"\0" * 3000)  # not text: left out when text files are present
    data = np.asarray(text.corpus(str(tmp_path)))
    assert bytes(data) == b"A" * 3000 + b"B" * 3000


def test_a_folder_says_which_files_it_leaves_out(tmp_path, capsys):
    """engine.cpp beside engine.h trained on the .h alone, without a word (87 % of the bytes left out in a QA run)."""
    (tmp_path / "engine.h").write_bytes(b"H" * 3000)
    (tmp_path / "engine.cpp").write_bytes(b"C" * 9000)
    assert bytes(np.asarray(text.corpus(str(tmp_path)))) == b"H" * 3000
    assert bytes(np.asarray(text.corpus(str(tmp_path)))) == b"H" * 3000  # the eval split's load: no second note
    err = capsys.readouterr().err
    assert "skipping 1 other(s), 9,000 bytes (e.g. 'engine.cpp')" in err and "or one file" in err
    assert err.count("skipping") == 1, err


def test_unigram_entropy():
    assert text.unigram_bits(np.frombuffer(CORPUS[:2560], np.uint8)) == pytest.approx(8.0)
    assert text.unigram_bits(np.frombuffer(b"abab", np.uint8)) == pytest.approx(1.0)


def test_default_corpus_is_the_standard_librarys_python_sources():
    files = text.stdlib_files()
    assert len(files) > 500 and all(f.endswith(".py") for f in files) and files == sorted(files)
    assert not any("site-packages" in f for f in files)
    data = text.corpus(None)
    assert len(data) == sum(os.path.getsize(f) for f in files)
    test = datasets.load("text", "test[:4]", data_path=None, seq_len=32)  # through the registry
    assert isinstance(test, text.TextDataset) and len(test) == 4 and test.vocab_size == 256
    assert 4.0 < test.unigram_bits < 5.5  # Python 3.11's: 4.69 bits


@pytest.mark.parametrize("kwargs, message", [
    (dict(split="valid"), "split 'valid' is not valid"),
    (dict(split="test[0:0]"), "selects no windows"),
    (dict(split="test[:8000]"), "the bound 8000 lies beyond the 2 windows .test. has"),
    (dict(seq_len=0), "--seq-len 0 must be an int >= 1"),
    (dict(split="test", seq_len=600), r"held-out last 5% holds 513, too few for one window of --seq-len 600 \(601 "
                                      r"bytes with its last target\); pass at least 12020 bytes.*--eval-split 'train\[90%:\]'"),
    (dict(seq_len=9735), r"the training part \(the first 95%\) holds 9735, too few for one window of --seq-len "
                         r"9735.*at least 10249 bytes of text, or a shorter --seq-len\.$"),
    (dict(path="/nonexistent/text"), "neither a file nor a folder"),
])
def test_bad_input_is_one_line_naming_the_fix(corpus_file, kwargs, message):
    kwargs = {"split": "train", "path": corpus_file, **kwargs}
    with pytest.raises(ValueError, match=message) as e:
        text.load(kwargs.pop("split"), **kwargs)
    assert "\n" not in str(e.value)


def test_a_held_out_part_too_short_refuses_only_the_test_split(corpus_file):
    """10,248 bytes hold 601-byte windows in the training part (9,735 bytes) but not in the held-out 513: a run
    that never reads the held-out part (--eval-split '', or a validation slice of train) trains (both splits were
    refused, 'too few for windows of --seq-len 600 in both parts')."""
    train = text.load("train", corpus_file, seq_len=600)
    assert len(train) == 16 and train.batch(np.arange(16))["x"].shape == (16, 600)
    assert len(text.load("train[80%:]", corpus_file, seq_len=600)) == 3
    with pytest.raises(ValueError, match="held-out last 5% holds 513"):
        text.load("test", corpus_file, seq_len=600)


def test_percent_bounds_round_to_the_closest_window():
    """A percent bound is rounded to the closest window, as tfds rounds its percent slices: 90 % of 3 windows is
    2.7, so 'train[:90%]' holds 3 (not 2, truncated); 27 % of 10 is 2.7, so 'test[27%:]' starts at window 3."""
    assert text.parse_split("train[:90%]", {"train": 3, "test": 10}) == ("train", 0, 3)
    assert text.parse_split("test[27%:]", {"train": 3, "test": 10}) == ("test", 3, 10)


@pytest.mark.parametrize("spec", ["test[:8000]", "test[-60:]", "train[:150%]", "train[1:10%]", "train[:]",
                                  "train[1.:5]", "test[:12.5%]", "test[-50:]", "train[:-100%]", "test[3:40%]"])
def test_slices_read_as_tfds_reads_them(spec):
    """A text split is read by tfds's rules, as every other source's: an out-of-range absolute bound is refused (it
    was cut to the windows there are: 'test[:8000]' of 50 gave 50), a slice with one percent bound is in percent
    ('train[1:10%]' was windows 1 to 10 %), a percent beyond 100 is refused. tfds itself is the reference."""
    from types import SimpleNamespace

    from tensorflow_datasets.core import splits as tfds_splits

    sizes = {"train": 100, "test": 50}
    infos = {s: SimpleNamespace(num_examples=n, shard_lengths=[n]) for s, n in sizes.items()}
    try:
        (a,) = tfds_splits.ReadInstruction.from_spec(spec).to_absolute(infos)
        expected = (a.splitname, a.from_ or 0, sizes[a.splitname] if a.to is None else a.to)
    except ValueError:
        expected = None
    if expected is None or expected[2] <= expected[1]:
        with pytest.raises(text.TextError) as e:
            text.parse_split(spec, sizes)
        assert spec in str(e.value) and "\n" not in str(e.value)
    else:
        assert text.parse_split(spec, sizes) == expected
