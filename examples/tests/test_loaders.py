"""The loaders of ``gact_examples.data`` on tiny files in the real formats."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from gact_examples import data
from gact_examples.testing import make_planetoid, write_idx


def test_read_idx_roundtrip(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", arr)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "a.gz"), arr)


def test_read_idx_rejects_bad_files(tmp_path):
    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(b"\x01\x02\x08\x01" + (3).to_bytes(4, "big") + b"\x00\x00\x00")
    with pytest.raises(ValueError, match="magic"):
        data.read_idx(tmp_path / "bad.gz")
    with gzip.open(tmp_path / "short.gz", "wb") as f:
        f.write(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"\x00")
    with pytest.raises(ValueError, match="expected 5"):
        data.read_idx(tmp_path / "short.gz")


def test_load_mnist(data_root):
    for where in (data_root, data_root / "mnist"):  # parent or dataset dir
        d = data.load_mnist(where)
        assert d["x_train"].shape == (64, 28, 28) and d["x_train"].dtype == np.uint8
        assert d["x_test"].shape == (32, 28, 28)
        assert d["y_train"].dtype == np.int64 and set(d["y_train"]) == set(range(10))


def test_missing_dir_has_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        data.load_mnist(tmp_path)


def test_load_planetoid_split_and_reorder(tmp_path):
    info = make_planetoid(tmp_path)
    d = data.load_planetoid(tmp_path, "cora")
    n = len(info["labels"])
    assert d["x"].shape == (n, 20) and d["x"].dtype == np.float32
    # test rows were put back at their node ids: features/labels match the generator's
    np.testing.assert_array_equal(d["y"], info["labels"])
    np.testing.assert_array_equal(d["x"], info["feats"])
    np.testing.assert_array_equal(d["train_idx"], np.arange(140))
    np.testing.assert_array_equal(d["val_idx"], np.arange(140, 640))
    np.testing.assert_array_equal(d["test_idx"], info["test_ids"])
    e = d["edge_index"]
    assert e.shape[0] == 2 and e.shape[1] > 0
    assert not np.any(e[0] == e[1])  # no self loops
    pairs = set(map(tuple, e.T))
    assert all((b, a) in pairs for a, b in pairs)  # undirected
    assert int(d["num_classes"]) == 3


def test_load_cifar10_and_cache(data_root, tmp_path):
    cache = tmp_path / "c"
    d = data.load_cifar10(data_root, cache_dir=cache, verbose=False)
    assert d["x_train"].shape == (30, 32, 32, 3) and d["x_train"].dtype == np.uint8
    assert d["x_test"].shape == (20, 32, 32, 3)
    np.testing.assert_array_equal(d["y_train"], np.repeat(np.arange(10), 3))
    # colour channel c%3 carries 25*c (JPEG is lossy: allow a few levels)
    for c in range(1, 10):
        px = d["x_train"][3 * c].astype(int)
        assert abs(px[..., c % 3].mean() - 25 * c) < 4, data.CIFAR10_CLASSES[c]
    files = list(cache.glob("cifar10-*.npz"))
    assert len(files) == 1
    d2 = data.load_cifar10(data_root, cache_dir=cache, verbose=False)  # from the cache
    np.testing.assert_array_equal(d2["x_test"], d["x_test"])


def test_load_char_corpus(data_root):
    d = data.load_char_corpus(data_root)
    assert len(d["train"]) + len(d["val"]) == len(
        (data_root / "tinyshakespeare/input.txt").read_text()
    )
    assert d["train"].max() < len(d["chars"]) and d["chars"] == sorted(d["chars"])


def test_load_passage_classes(tmp_path):
    """Labels follow the part of the corpus, training passages stay inside training chunks,
    held-out passages tile the held-out chunks."""
    n, chunk, passage = 64 * 10 + 5, 64, 16
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text(" ".join(f"w{i}" for i in range(n)))
    d = data.load_passage_classes(tmp_path, classes=2, passage=passage, chunk=chunk, test_every=5)
    position = np.array([int(word[1:]) for word in d["vocab"]])  # token id -> corpus index
    np.testing.assert_array_equal(position[d["ids"]], np.arange(n))
    starts = position[d["ids"][d["train_starts"]]]
    held_out = {4, 9}  # every 5th of the 10 whole chunks (the last 5 words are dropped)
    assert len(starts) == 8 * (chunk - passage + 1) and len(set(starts)) == len(starts)
    assert not held_out & set(starts // chunk) and (starts % chunk + passage <= chunk).all()
    np.testing.assert_array_equal(d["train_y"], starts // chunk * 2 // 10)
    expected = [c * chunk + t * passage for c in sorted(held_out) for t in range(4)]
    np.testing.assert_array_equal(
        position[d["test_x"]], np.array(expected)[:, None] + np.arange(passage)
    )
    np.testing.assert_array_equal(d["test_y"], [0] * 4 + [1] * 4)
    with pytest.raises(ValueError, match="passage must be"):
        data.load_passage_classes(tmp_path, passage=chunk + 1, chunk=chunk)
    with pytest.raises(ValueError, match="held-out chunk"):
        data.load_passage_classes(tmp_path, classes=4, chunk=chunk, passage=passage)


def test_load_digits_split():
    d = data.load_digits_split()
    assert d["x_train"].shape[1:] == (8, 8) and d["x_train"].dtype == np.uint8
    assert len(d["x_train"]) + len(d["x_test"]) == 1797
