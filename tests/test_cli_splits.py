"""Evaluation on samples the run trained on: overlapping --train-split / --eval-split warn and are recorded."""
import numpy as np

from jaxpar.config import Config
from jaxpar.run import trainer


def test_split_overlap_counts_shared_samples():
    sizes = {"train": 60, "test": 20}
    load = lambda s: range(sizes[s])  # noqa: E731  (only the sizes are read)
    overlap = lambda a, b: trainer.split_overlap(a, b, "npz", {}, load)  # noqa: E731
    assert overlap("test[:8]", "test") == 8
    assert overlap("train+test", "test") == 20
    assert overlap("train[:10%]+test[:50%]", "test[25%:]") == 5  # test 5:10
    assert overlap("test[:8]", "test[8:]") == 0 and overlap("train", "test") == 0
    assert overlap("test[-4:]", "test[10:]") == 4
    windows = lambda s: range({"train": 100, "test": 30}[s])  # noqa: E731
    assert trainer.split_overlap("test[:10]", "test", "text", {}, windows) == 10


def test_text_overlap_check_loads_only_the_named_split():
    """A validation slice of train ('train[90%:]') must not load the held-out part: on a corpus whose held-out 5 %
    is shorter than one window, that load refused the run ('too few for windows') though nothing reads it."""
    def windows(split):
        assert split == "train", f"the {split!r} split was loaded"
        return range(100)
    assert trainer.split_overlap("train[:90%]", "train[90%:]", "text", {}, windows) == 0
    assert trainer.split_overlap("train[:50]", "train[40:]", "text", {}, windows) == 10


def test_overlapping_eval_split_warns_before_training_and_is_recorded(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x, xt = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(12, 4)).astype(np.float32)
    label = lambda a: (a[:, 0] > 0).astype(np.int32)  # noqa: E731
    np.savez(tmp_path / "d.npz", x=x, y=label(x), x_test=xt, y_test=label(xt))
    base = Config(model="linear", dataset="npz", data_path=str(tmp_path / "d.npz"), batch_size=4, steps=1, quiet=True)
    seen = []
    summary = trainer.run(base.replace(train_split="test[:8]"), on_step=lambda *a: seen.append(capsys.readouterr().err))
    assert "--eval-split 'test' shares 8 samples with --train-split 'test[:8]'" in seen[0]  # before the first step
    assert "pass --eval-split 'test[8:]'" in seen[0] and len(seen[0].strip().splitlines()) == 1
    assert summary["eval_overlaps_train"] == 8 and "eval_overlaps_train=8" in capsys.readouterr().out
    clean = trainer.run(base.replace(train_split="test[:8]", eval_split="test[8:]"))
    assert "eval_overlaps_train" not in clean and "shares" not in capsys.readouterr().err


def test_steps_override_epochs_with_a_note(tmp_path, capsys):
    """--steps with --epochs: --steps sets the run's length (Hugging Face's max_steps over num_train_epochs), and a
    note says so (a review found --epochs 1 --steps 10 running 3 epochs without a word)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    base = Config(model="linear", dataset="npz", data_path=str(tmp_path / "d.npz"), batch_size=4, quiet=True,
                  train_split="train", eval_split="")
    summary = trainer.run(base.replace(epochs=1, steps=5))
    assert summary["steps"] == 5 and summary["epochs"] >= 2  # past the one epoch asked for
    assert "--steps 5 sets the run's length, not --epochs 1" in capsys.readouterr().err
    trainer.run(base.replace(steps=2))
    assert "note" not in capsys.readouterr().err
