"""Tiny datasets in the real on-disk formats, written from scratch (for tests and dry runs).

Each writer creates the folder a loader in :mod:`gact_examples.data` expects, under ``root``,
with a few learnable examples; :func:`make_all` writes all four, so that ``--data root`` works
for every example script without the real data.

Example:
    >>> import tempfile
    >>> from gact_examples.data import load_mnist
    >>> root = make_all(Path(tempfile.mkdtemp()))
    >>> load_mnist(root)["x_train"].shape
    (64, 28, 28)
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .data import CIFAR10_ARCHIVE, CIFAR10_CLASSES

__all__ = ["make_all", "make_cifar", "make_mnist", "make_planetoid", "make_text", "write_idx"]


def write_idx(path: Path, arr: np.ndarray) -> None:
    """Write ``arr`` (uint8 or big-endian int32) as a gzip-compressed idx file."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[arr.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.tobytes())


def make_mnist(root: Path, n_train: int = 64, n_test: int = 32) -> Path:
    """``root/mnist``: 28x28 noise images with a bright bar whose position is the label."""
    d = root / "mnist"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = (np.arange(n) % 10).astype(np.uint8)
        x = rng.integers(0, 50, size=(n, 28, 28), dtype=np.uint8)
        for i, label in enumerate(y):  # a learnable bright bar per class
            x[i, 2 + 2 * label : 4 + 2 * label, 4:24] = 255
        write_idx(d / f"{prefix}-images-idx3-ubyte.gz", x)
        write_idx(d / f"{prefix}-labels-idx1-ubyte.gz", y)
    return d


def make_planetoid(
    root: Path, name: str = "cora", n_nodes: int = 700, n_feat: int = 20, n_classes: int = 3
) -> dict[str, Any]:
    """A random graph in the Planetoid layout: 140 labelled x/y, allx/ally for the first
    n_all nodes, test nodes after them listed in shuffled order in test.index."""
    import scipy.sparse as sp

    d = root / name
    d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    labels = rng.integers(0, n_classes, n_nodes)
    feats = (rng.random((n_nodes, n_feat)) < 0.1).astype(np.float32)
    feats[np.arange(n_nodes), labels] = 1.0  # class-revealing feature
    onehot = np.eye(n_classes, dtype=np.int32)[labels]
    n_test = 50
    n_all = n_nodes - n_test
    test_ids = np.arange(n_all, n_nodes)
    test_order = rng.permutation(test_ids)  # the file lists test nodes unsorted
    graph = defaultdict(list)
    for i in range(n_nodes):
        for j in rng.integers(0, n_nodes, 3):
            if labels[j] == labels[i] and i != j:
                graph[int(i)].append(int(j))
    objs = {
        "x": sp.csr_matrix(feats[:140]),
        "y": onehot[:140],
        "allx": sp.csr_matrix(feats[:n_all]),
        "ally": onehot[:n_all],
        # tx/ty row k belongs to node test_order[k] (the k-th line of test.index)
        "tx": sp.csr_matrix(feats[test_order]),
        "ty": onehot[test_order],
        "graph": graph,
    }
    for k, v in objs.items():
        with open(d / f"ind.{name}.{k}", "wb") as f:
            pickle.dump(v, f, protocol=2)
    (d / f"ind.{name}.test.index").write_text("".join(f"{i}\n" for i in test_order))
    return {"dir": d, "labels": labels, "feats": feats, "test_ids": test_ids}


def make_cifar(root: Path, per_class_train: int = 3, per_class_test: int = 2) -> Path:
    """A tiny cifar10_jpg.tar.gz: members cifar10_jpg/{train,test}/<class>/<NNNN>.jpg."""
    from PIL import Image

    d = root / "cifar10-jpg"
    d.mkdir(parents=True)
    with tarfile.open(d / CIFAR10_ARCHIVE, "w:gz") as tar:
        for split, n in (("train", per_class_train), ("test", per_class_test)):
            for c, cls in enumerate(CIFAR10_CLASSES):
                for i in range(n):
                    img = np.zeros((32, 32, 3), dtype=np.uint8)
                    img[..., c % 3] = 25 * c  # colour encodes the class
                    buf = io.BytesIO()
                    Image.fromarray(img).save(buf, format="JPEG", quality=95)
                    info = tarfile.TarInfo(f"cifar10_jpg/{split}/{cls}/{i:04d}.jpg")
                    info.size = buf.getbuffer().nbytes
                    buf.seek(0)
                    tar.addfile(info, buf)
    return d


def make_text(root: Path) -> Path:
    """``root/tinyshakespeare/input.txt``: a short repeated text."""
    d = root / "tinyshakespeare"
    d.mkdir(parents=True)
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 40
    (d / "input.txt").write_text(text)
    return d


def make_all(root: Path) -> Path:
    """Write the four tiny datasets under ``root`` (``mnist/``, ``cora/``, ``cifar10-jpg/``,
    ``tinyshakespeare/``) and return ``root``."""
    make_mnist(root)
    make_planetoid(root)
    make_cifar(root)
    make_text(root)
    return root
