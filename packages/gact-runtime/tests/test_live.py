"""The tables of this forward's saves (live.py): when a tensor, or an alias of its storage,
finds what its first save returned, and when it must not."""

from __future__ import annotations

import gc

import torch
from gact.live import LiveStorages, LiveTable, storage_address


class Held:
    """Stands for a ``Saved``: the tables hold it weakly."""


def test_a_tensor_finds_its_save_in_the_same_forward_only() -> None:
    table, t, held = LiveTable(), torch.randn(4), Held()
    table.add(t, held, forward=3)
    assert table.get(t, 3) is held
    assert table.get(t, 4) is None  # a later forward: the entry can no longer match
    assert table.get(t.detach(), 3) is None  # another object (aliases are LiveStorages' job)


def test_an_in_place_change_or_a_swapped_storage_misses() -> None:
    table, held = LiveTable(), Held()
    changed, swapped = torch.randn(4), torch.randn(4)
    table.add(changed, held, 0)
    table.add(swapped, held, 0)
    changed.add_(1)  # new version
    swapped.data = torch.randn(4)  # same version, other storage
    assert table.get(changed, 0) is None
    assert table.get(swapped, 0) is None


def test_an_entry_dies_with_its_save_or_its_tensor() -> None:
    table, t, held = LiveTable(), torch.randn(4), Held()
    table.add(t, held, 0)
    other, other_held = torch.randn(4), Held()
    table.add(other, other_held, 0)
    assert len(table) == 2
    del held
    gc.collect()
    assert len(table) == 1 and table.get(t, 0) is None
    del other
    gc.collect()
    assert len(table) == 0
    table.add(t, other_held, 0)
    table.discard(t)
    assert len(table) == 0


def test_an_alias_of_the_same_storage_view_finds_the_save() -> None:
    storages, base, held = LiveStorages(), torch.randn(6, 4), Held()
    view = base[1:3]
    storages.add(view, held, 0)
    assert storages.get(base[1:3], 0) is held  # another object, the same elements
    assert storages.get(view.detach(), 0) is held
    assert storages.get(base[1:4], 0) is None  # other elements
    assert storages.get(base[1:3].t(), 0) is None  # other strides
    assert storages.get(base[1:3], 1) is None  # another forward
    base[1, 0] = 0.0  # the version counter every alias shares
    assert storages.get(base[1:3], 0) is None


def test_lazy_bits_make_another_storage_view() -> None:
    storages, z, held = LiveStorages(), torch.randn(4, dtype=torch.complex64), Held()
    storages.add(z, held, 0)
    assert storages.get(z.conj(), 0) is None  # same storage, other values
    assert storages.get(torch._neg_view(z), 0) is None
    assert storages.get(z.view(z.shape), 0) is held
    storages.clear()
    assert len(storages) == 0 and storages.get(z, 0) is None


def test_storage_address_follows_the_storage_not_the_version() -> None:
    t = torch.randn(4)
    before = storage_address(t)
    assert before == t.untyped_storage().data_ptr() != 0
    t.data = torch.randn(4)
    assert storage_address(t) != before and t._version == 0
    assert storage_address(torch.randn(4, 4).to_sparse()) == 0  # no strided storage
