"""Loaders for the four on-disk formats the examples use, plus scikit-learn's bundled digits.

Every loader reads local files only; nothing is ever downloaded. ``data`` may point either at
the dataset's own folder (``.../cora``) or at the folder holding all of them (``.../data``).

Example:
    >>> d = load_digits_split()
    >>> d["x_train"].shape, d["x_train"].dtype.name, len(d["x_test"])
    ((1438, 8, 8), 'uint8', 359)
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import re
import struct
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = [
    "CIFAR10_ARCHIVE",
    "CIFAR10_CLASSES",
    "default_cache_dir",
    "default_data_root",
    "load_char_corpus",
    "load_cifar10",
    "load_digits_split",
    "load_mnist",
    "load_passage_classes",
    "load_planetoid",
    "read_idx",
    "resolve_dir",
    "words",
]

CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
CIFAR10_ARCHIVE = "cifar10_jpg.tar.gz"


def default_data_root() -> str | None:
    """The default ``--data``: ``$GACT_DATA`` if set, else None (the scripts then ask for it)."""
    return os.environ.get("GACT_DATA") or None


def default_cache_dir() -> Path:
    """Decoded-array cache, outside the repository: ``$GACT_EXAMPLES_CACHE`` or ~/.cache."""
    env = os.environ.get("GACT_EXAMPLES_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gact-examples"


def resolve_dir(data: str | os.PathLike, subdir: str, marker: str) -> Path:
    """Return the directory holding ``marker``: ``data`` itself or ``data/subdir``."""
    root = Path(data).expanduser()
    for cand in (root, root / subdir):
        if (cand / marker).exists():
            return cand
    raise FileNotFoundError(
        f"cannot find {marker!r} in {root} or {root / subdir}; pass --data pointing at the "
        f"{subdir} directory (or at its parent)"
    )


# --------------------------------------------------------------------------------------------
# MNIST (idx, gzip-compressed)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one idx file (``.gz`` or raw) into a numpy array of its stored dtype."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an idx file (bad magic)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = raw[2], raw[3]
    if code not in dtypes:
        raise ValueError(f"{path}: unknown idx type code {code:#x}")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(dtypes[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = raw[4 + 4 * ndim :]
    if len(body) != expected:
        raise ValueError(f"{path}: expected {expected} data bytes, found {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def load_mnist(data: str | os.PathLike) -> dict[str, np.ndarray]:
    """MNIST as uint8 images ``(N, 28, 28)`` and int64 labels, keys x_train/y_train/x_test/y_test."""
    d = resolve_dir(data, "mnist", "train-images-idx3-ubyte.gz")
    out = {
        "x_train": read_idx(d / "train-images-idx3-ubyte.gz"),
        "y_train": read_idx(d / "train-labels-idx1-ubyte.gz").astype(np.int64),
        "x_test": read_idx(d / "t10k-images-idx3-ubyte.gz"),
        "y_test": read_idx(d / "t10k-labels-idx1-ubyte.gz").astype(np.int64),
    }
    for split in ("train", "test"):
        if len(out[f"x_{split}"]) != len(out[f"y_{split}"]):
            raise ValueError(f"MNIST {split}: image and label counts differ")
    return out


# --------------------------------------------------------------------------------------------
# CIFAR-10 (one tar.gz of JPEGs: cifar10_jpg/{train,test}/<class>/<NNNN>.jpg)


def _decode_cifar_archive(archive: Path) -> dict[str, np.ndarray]:
    from PIL import Image

    buckets: dict[str, list[tuple[int, int, np.ndarray]]] = {"train": [], "test": []}
    class_index = {c: i for i, c in enumerate(CIFAR10_CLASSES)}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if not member.isfile() or not member.name.endswith(".jpg"):
                continue
            parts = member.name.split("/")
            if len(parts) < 3:
                continue
            split, cls, fname = parts[-3], parts[-2], parts[-1]
            if split not in buckets or cls not in class_index:
                continue
            f = tar.extractfile(member)
            assert f is not None
            with Image.open(io.BytesIO(f.read())) as img:
                arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
            buckets[split].append((class_index[cls], int(Path(fname).stem), arr))
    out: dict[str, np.ndarray] = {}
    for split, items in buckets.items():
        if not items:
            raise ValueError(f"{archive}: no {split}/<class>/*.jpg members found")
        items.sort(key=lambda t: (t[0], t[1]))  # class, then id: deterministic order
        out[f"x_{split}"] = np.stack([a for _, _, a in items])
        out[f"y_{split}"] = np.array([c for c, _, _ in items], dtype=np.int64)
    return out


def load_cifar10(
    data: str | os.PathLike, cache_dir: str | os.PathLike | None = None, verbose: bool = True
) -> dict[str, np.ndarray]:
    """CIFAR-10 as uint8 ``(N, 32, 32, 3)`` images and int64 labels (class-sorted order).

    The 60k JPEGs are decoded with Pillow once and cached as ``.npz`` under ``cache_dir``
    (default ``~/.cache/gact-examples``), keyed by the archive's size and mtime.
    """
    d = resolve_dir(data, "cifar10-jpg", CIFAR10_ARCHIVE)
    archive = d / CIFAR10_ARCHIVE
    st = archive.stat()
    key = hashlib.sha1(f"{archive.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache / f"cifar10-{key[:16]}.npz"
    if cached.exists():
        with np.load(cached) as z:
            return {k: z[k] for k in z.files}
    if verbose:
        print(f"decoding {archive} once (cache: {cached}) ...", file=sys.stderr, flush=True)
    out = _decode_cifar_archive(archive)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, **out)
        os.replace(tmp, cached)
    except OSError as exc:  # a read-only home is not fatal: decode again next time
        print(f"warning: could not write cache {cached}: {exc}", file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------------
# Cora (Planetoid pickles)


class _PlanetoidUnpickler(pickle.Unpickler):
    """Python-2 pickles of scipy.sparse matrices; map the old private module paths."""

    def find_class(self, module: str, name: str):
        if module.startswith("scipy.sparse.") and name.endswith("_matrix"):
            module = "scipy.sparse"
        return super().find_class(module, name)


def _load_pickle(path: Path):
    with open(path, "rb") as f:
        return _PlanetoidUnpickler(f, encoding="latin1").load()


def load_planetoid(data: str | os.PathLike, name: str = "cora") -> dict[str, np.ndarray]:
    """Planetoid split of ``name``: dense float32 features, int64 labels, COO edges, masks.

    Standard split: train = first 140 labelled nodes (``len(y)``), val = the next 500, test =
    the nodes listed in ``ind.<name>.test.index``. Row k of ``tx``/``ty`` belongs to the k-th id in
    that file (unsorted); stacked after ``allx`` they sit at the sorted positions and are moved to
    their node ids (the usual reorder fix).
    """
    import scipy.sparse as sp

    d = resolve_dir(data, name, f"ind.{name}.x")
    objs = {k: _load_pickle(d / f"ind.{name}.{k}") for k in ("x", "y", "tx", "ty", "allx", "ally")}
    graph = _load_pickle(d / f"ind.{name}.graph")
    test_index = np.loadtxt(d / f"ind.{name}.test.index", dtype=np.int64).reshape(-1)
    test_sorted = np.sort(test_index)

    tx, ty = objs["tx"], objs["ty"]
    lo, hi = int(test_sorted.min()), int(test_sorted.max())
    if name == "citeseer":  # isolated test nodes: pad with zero rows (as in the GCN code)
        full = hi - lo + 1
        tx_ext = sp.lil_matrix((full, tx.shape[1]), dtype=np.float32)
        tx_ext[test_sorted - lo, :] = tx
        tx = tx_ext
        ty_ext = np.zeros((full, ty.shape[1]), dtype=ty.dtype)
        ty_ext[test_sorted - lo, :] = ty
        ty = ty_ext

    features = sp.vstack([objs["allx"], tx]).tolil()
    features[test_index, :] = features[test_sorted, :]
    labels_onehot = np.vstack([objs["ally"], ty])
    labels_onehot[test_index, :] = labels_onehot[test_sorted, :]

    n = features.shape[0]
    src, dst = [], []
    for node, neigh in graph.items():
        for m in neigh:
            if node != m and node < n and m < n:
                src.append(node)
                dst.append(m)
    edges = np.array([src, dst], dtype=np.int64).reshape(2, -1)
    # make undirected and drop duplicates
    both = np.concatenate([edges, edges[::-1]], axis=1)
    edges = np.unique(both, axis=1)

    n_train = objs["y"].shape[0]
    train_idx = np.arange(n_train)
    val_idx = np.arange(n_train, n_train + 500)
    return {
        "x": np.asarray(features.todense(), dtype=np.float32),
        "y": labels_onehot.argmax(1).astype(np.int64),
        "edge_index": edges,
        "train_idx": train_idx,
        "val_idx": val_idx,
        "test_idx": test_sorted,
        "num_classes": np.int64(labels_onehot.shape[1]),
    }


# --------------------------------------------------------------------------------------------
# tiny-shakespeare (plain text, character level)


def _corpus_ids(
    data: str | os.PathLike, tokenize: Callable[[str], list[str]] = list
) -> tuple[Path, list[str], np.ndarray]:
    """The corpus file, its sorted vocabulary and the corpus as int64 ids into it."""
    path = resolve_dir(data, "tinyshakespeare", "input.txt") / "input.txt"
    tokens = tokenize(path.read_text(encoding="utf-8"))
    vocab = sorted(set(tokens))
    index = {t: i for i, t in enumerate(vocab)}
    return path, vocab, np.fromiter((index[t] for t in tokens), dtype=np.int64, count=len(tokens))


def load_char_corpus(data: str | os.PathLike, val_fraction: float = 0.1) -> dict:
    """Character-level corpus: vocabulary, int64 train/val token arrays (last 10% is val)."""
    path, chars, ids = _corpus_ids(data)
    if len(ids) < 2:
        raise ValueError(f"{path} is too short")
    n_val = max(1, int(len(ids) * val_fraction))
    return {"chars": chars, "train": ids[:-n_val], "val": ids[-n_val:]}


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks of ``text``, in order.

    Example:
        >>> words("Speak, ROMEO!  O'er")
        ['speak', ',', 'romeo', '!', "o'er"]
    """
    return re.findall(r"[\w']+|[^\w\s]", text.lower())


def load_passage_classes(
    data: str | os.PathLike,
    *,
    classes: int = 8,
    passage: int = 32,
    chunk: int = 512,
    test_every: int = 8,
) -> dict:
    """Which of ``classes`` equal parts of tiny-shakespeare a passage of words comes from.

    The corpus (as :func:`words`) is cut into chunks of ``chunk`` tokens; chunk ``j`` of ``n``
    belongs to part ``j * classes // n`` (its label), and every ``test_every``-th chunk is held
    out. Training passages of ``passage`` tokens start anywhere inside a training chunk and end
    inside it (none overlaps a held-out chunk); the held-out passages tile the held-out chunks
    without overlap. The corpus is a run of plays, so the parts differ in characters' names
    and subject: a topic classification.

    Returns:
        ``vocab`` (the tokens), ``ids`` (the whole corpus as int64 ids into it),
        ``train_starts`` and ``train_y`` (every training passage's first index and label),
        ``test_x`` (held-out passages, int64, N x ``passage``) and ``test_y``.

    Raises:
        ValueError: a passage longer than a chunk, or a corpus too short for every part to
            hold a training and a held-out chunk.
    """
    if not 1 <= passage <= chunk:
        raise ValueError(f"passage must be in [1, chunk={chunk}], got {passage}")
    if classes < 2 or test_every < 2:
        raise ValueError(f"need classes >= 2 and test_every >= 2, got {classes}, {test_every}")
    path, vocab, ids = _corpus_ids(data, words)
    n = len(ids) // chunk
    if n < classes * test_every:
        raise ValueError(
            f"{path} has {n} chunks of {chunk} words; {classes} parts with a held-out chunk "
            f"in every {test_every} need {classes * test_every}"
        )
    label = np.arange(n) * classes // n
    held_out = np.arange(n) % test_every == test_every - 1
    train, test = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    inside = np.arange(chunk - passage + 1)
    tiles = np.arange(chunk // passage) * passage
    test_starts = (test[:, None] * chunk + tiles).reshape(-1)
    return {
        "vocab": vocab,
        "ids": ids,
        "train_starts": (train[:, None] * chunk + inside).reshape(-1),
        "train_y": np.repeat(label[train], len(inside)),
        "test_x": ids[test_starts[:, None] + np.arange(passage)],
        "test_y": np.repeat(label[test], len(tiles)),
    }


# --------------------------------------------------------------------------------------------
# scikit-learn digits (bundled with scikit-learn; used by the demo)


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> dict[str, np.ndarray]:
    """The 1797 8x8 digits as uint8 0..255 images, split with a fixed permutation."""
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = np.clip(ds.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    y = ds.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    te, tr = perm[:n_test], perm[n_test:]
    return {"x_train": x[tr], "y_train": y[tr], "x_test": x[te], "y_test": y[te]}
