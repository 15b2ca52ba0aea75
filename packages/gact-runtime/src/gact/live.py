"""Tables of this forward's saves by tensor and by storage: a tensor saved again, or an alias of
its storage, is held as what its first save returned."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:
    from .saved import Saved

__all__ = ["LiveStorages", "LiveTable", "factor_from", "reads_for_factor", "storage_address"]


def storage_address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (0 for a layout without one): ``tensor.data = ...``
    changes it and not the version."""
    return tensor.untyped_storage().data_ptr() if tensor.layout is torch.strided else 0


class LiveTable:
    """Weak map from live tensors (same object, version, storage and forward) to what ``pack``
    returned for them."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, weakref.ref, int, int]] = {}

    def get(self, tensor: torch.Tensor, forward: int) -> Saved | None:
        entry = self._entries.get(id(tensor))
        if (
            entry is None
            or entry[0]() is not tensor
            or entry[1] != tensor._version
            or entry[3] != forward
            or entry[4] != storage_address(tensor)
        ):
            return None
        return entry[2]()

    def add(self, tensor: torch.Tensor, saved: Saved, forward: int) -> None:
        ident = id(tensor)
        entries = self._entries

        def forget(ref: weakref.ref) -> None:  # either side died: the entry is useless
            current = entries.get(ident)
            if current is not None and ref in (current[0], current[2]):
                del entries[ident]

        entries[ident] = (
            weakref.ref(tensor, forget),
            tensor._version,
            weakref.ref(saved, forget),
            forward,
            storage_address(tensor),
        )

    def discard(self, tensor: torch.Tensor) -> None:
        """Drop ``tensor``'s entry, if any."""
        self._entries.pop(id(tensor), None)

    def clear(self) -> None:
        """Drop every entry (a new forward starts: old entries can no longer match)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# NOTE [Boundary saves]
# A tensor a compiled graph returns and saves (a block ending in ReLU), and that the next graph or
# eager code saves again (the next block's first layer), reaches the hooks as two different Python
# objects, both aliases of one storage: AOTAutograd saves a ``detach`` of the output, and a graph's
# input may arrive as an alias of the caller's tensor. ``LiveTable``, keyed by object, does not see
# them as one, so such a tensor was stored twice, as two independent roundings (four tanh blocks
# compiled alone stored 1.7x, under aot_eager, and 1.5x, under inductor, what eager code stores;
# ``stats()`` counted it twice in the bytes autograd would hold, too). ``LiveStorages`` maps the
# saves at a compiled graph's boundary (its inputs and outputs), and while any compiled graph has
# saved, eager saves too, by storage, offset, shape, strides and dtype, to what their first save
# stored. Only boundaries: compiled code reuses an intermediate's buffer, unseen by its version
# counter, once its save is packed, but never an output it returned nor an input it was given. A
# weak reference to the storage keeps its address from being reused while the entry lives and tells
# when it died; the version counter, shared by every alias, tells an in-place change.

# NOTE [Aliased saves]
# Eager code saves aliases too: a linear layer on a 3-D input saves its own 2-D view of it
# (``input.view(-1, d)`` inside ``matmul``), so the queries, keys and values of a transformer
# (and a gated MLP's gate and up projections) save three (two) distinct view objects of one
# storage. PyTorch holds that storage once; keyed by object, GACT stored and rounded it three
# times (14-15% of the saved bytes of the model matrix's LLaMA-style decoder and ViT). So
# every eager save that is a view (``_is_view()``, 0.1 us) is also mapped by storage, offset,
# shape, strides, dtype and the lazy conjugate and negative bits (``h.conj()`` and
# ``torch._neg_view(h)`` alias ``h`` with other values: without the bits in the key, the
# gradient of ``h * h.conj()`` came out wrong), and a view that misses the object table is
# looked up there.
# Eager code never writes into a live storage behind its version counter, which every view
# shares with its base, and the weak reference to the storage tells when it died (its address
# may then be reused). The readers of one stored rounding are different calls, so each adds
# its own error to its own parameters' gradients, each unbiased (but see NOTE [Products of a
# shared save]); a key's measured sensitivity sums its readers' terms (NOTE [Measured
# sensitivities] in measured.py). A call that asks its
# save for a width or groups of its own (``DecisionSpec.shapes``: a fused attention's queries
# and keys, a BatchNorm input on small maps, a norm's rows) does not reuse a compressed save
# another call made, alias or the same object (its own saves share one: RMSNorm's composite
# saves its input twice, ``SavedCompressed.shaped_by``), nor does a compiled graph's boundary save
# that needs one (a compiled fused attention's queries): the queries saved first by a
# product at the level's width were read by the attention's backward at that width, 2 bits
# short in eager code and 2 below ``ATTENTION_BITS`` in a compiled graph.
# A view in another shape, or of part of the elements, is its own key there, so the output of an
# activation that saves it (ReLU, tanh, sigmoid) on a tokens-by-features batch was stored again by
# the next linear layer's 2-D view of it, and an attention's output by the output projection's
# view of it (PyTorch's ``nn.TransformerEncoderLayer`` with ReLU and no dropout stored 1.31x what
# it stores now, a tanh MLP on tokens 1.32x). So a compressed save records the dense block its
# elements fill as it unpacks (``SavedCompressed.span``: none for tables, lazily negated or
# conjugated tensors and tensors with gaps or overlaps, which unpack contiguous), and a view that
# misses both tables and whose elements all lie in the block of its base's save, or of the first
# compressed view of that base (a base saved after a view of it too), is held as that save
# (``SavedView``: unpacked with the view's shape, strides and offset by ``as_strided``), if it is
# saved in the model and its storage is still the one the block was recorded on (``tensor.data =
# ...`` swaps a storage without a new version). The meter reads a payload in the saved tensor's
# shape, so only a view of the whole block in memory order is measured through it
# (``SavedView.rows``); the readers of other views are probed.


# NOTE [Products of a shared save]
# One rounding read twice in one product is no longer unbiased: in ``l2(h) * h`` the product's
# gradient of ``z = l2(h)`` is ``g * h'``, and ``l2``'s weight gradient is that times ``h'``
# again, so with one stored ``h'`` it holds ``h'^2``, whose mean is ``h^2`` plus the rounding's
# variance (14% of the diagonal at 2 bits, 0.5% at 4, over 200 seeds; highway and
# ``x * sigmoid(W x)`` gates have that form; so do divisions, ``h / f(l2(h))``). It takes a
# save that a product reads into another factor's gradient (``SavedCompressed.factor_read``:
# a linear or convolution layer's weight, a parametrized or cast weight, any factor that
# requires grad) and a later product that reads the same tensor with a factor computed from it:
# the first reader's output must lead to that factor, so it runs first, and the two meet in
# the first reader's gradient of its factor. ``DecisionMode`` publishes the arguments of
# products and divisions (``linear_rules.PRODUCTS``); a factor may be computed from the saved
# tensor when its autograd node (of its base, for a view) is younger than the tensor's
# (``_sequence_nr``: autograd numbers the nodes of a thread in creation order), or the tensor
# has none. Such a product stores the tensor again, with its own rounding, and the ledger counts
# its bytes once, as autograd holds them. Products with an older factor (attention's ``P @ V``:
# ``V`` was computed before ``P``) still share, and so does every other call: in a nonlinear
# formula (a norm written out, ``x * rsqrt(mean(x^2))``) a second rounding would leave the bias
# of second order that such formulas have anyway (``README``'s guarantees), for the memory of one
# more copy. Not seen: compiled graphs and recomputed activations (left as they are), products
# inside a composite that ``DecisionMode`` sees as one call (``F.multi_head_attention_forward``'s
# projections), and a factor made on another thread (``DataParallel``'s replicas: its node is
# numbered by that thread's counter).
def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (``tensor`` itself if it is no view)."""
    return tensor._base if tensor._is_view() else tensor


def reads_for_factor(tensor: torch.Tensor, factors: list[torch.Tensor]) -> bool:
    """Whether the running product (``factors``, its tensor arguments) reads ``tensor`` into
    another factor's gradient: one that requires grad (NOTE above)."""
    base = _root(tensor)
    for factor in factors:
        if _root(factor) is not base and factor.requires_grad:
            return True
    return False


def factor_from(tensor: torch.Tensor, factors: list[torch.Tensor]) -> bool:
    """Whether another of the running product's ``factors`` may be computed from ``tensor``
    (NOTE above)."""
    base = _root(tensor)
    node = base.grad_fn
    born = -1 if node is None else node._sequence_nr()
    for factor in factors:
        root = _root(factor)
        if root is base or not factor.requires_grad:
            continue
        made = root.grad_fn
        if made is not None and made._sequence_nr() > born:
            return True
    return False


class LiveStorages:
    """Weak map from live storages (same storage, offset, shape, strides, dtype, lazy
    conjugate and negative bits, version and forward) to what ``pack`` returned for a tensor
    on them (NOTE [Boundary saves], NOTE [Aliased saves])."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[StorageWeakRef, int, weakref.ref, int]] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return (
            tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype, tensor.is_conj(), tensor.is_neg(),
        )  # fmt: skip

    def get(self, tensor: torch.Tensor, forward: int) -> Saved | None:
        entry = self._entries.get(self._key(tensor))
        if (
            entry is None
            or entry[0].expired()
            or entry[1] != tensor._version
            or entry[3] != forward
        ):
            return None
        return entry[2]()

    def add(self, tensor: torch.Tensor, saved: Saved, forward: int) -> None:
        storage = tensor.untyped_storage()
        self._entries[self._key(tensor)] = (
            StorageWeakRef(storage),
            tensor._version,
            weakref.ref(saved),
            forward,
        )

    def clear(self) -> None:
        """Drop every entry (a new forward starts: old entries can no longer match)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
