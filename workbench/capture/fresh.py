"""New fake tensors for a copy of part of a graph, aliasing as the originals do.

Entry point: `FreshValues` (`workbench.capture.stamp` gives each stamped layer its own): the
workbench finds aliases by storage identity (`rewrite/index.py`, `ops.storage_inputs`), so
copies must not share the template's storages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["FreshValues", "flat"]


def flat(value: Any) -> list[Any]:
    """A node value as a list of values (a multi-output op's tuple, or the one value).

    >>> flat((1, 2)), flat(3)
    ([1, 2], [3])
    """
    return list(value) if isinstance(value, (list, tuple)) else [value]


class FreshValues:
    """New fake tensors for one copy of a layer: the template's sizes, strides, offsets and
    dtypes on new storages, shared where the template's are (views stay views of the copy's
    own tensors); storages of nodes outside the copy are the new inputs' (`seed`)."""

    def __init__(self, keys: dict[int, StorageWeakRef]) -> None:
        self.keys = keys  # id(template tensor) -> its storage, shared by every copy
        self.storages: dict[StorageWeakRef, Any] = {}
        self.tensors: dict[int, torch.Tensor] = {}  # id(template tensor) -> its copy

    def key(self, value: torch.Tensor) -> StorageWeakRef:
        """The template tensor's storage (kept by id: the template lives while copies are made)."""
        key = self.keys.get(id(value))
        if key is None:
            key = self.keys[id(value)] = StorageWeakRef(value.untyped_storage())
        return key

    def seed(self, old: Any, new: Any) -> None:
        """A value outside the copy that the copy reads: `old`'s storages become `new`'s."""
        for o, n in zip(flat(old), flat(new), strict=False):
            if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor):
                self.storages.setdefault(self.key(o), n.untyped_storage())
                self.tensors.setdefault(id(o), n)

    def __call__(self, value: Any) -> Any:
        """The copy of a template value: tensors new (or on a seeded storage), the rest kept."""
        if isinstance(value, (list, tuple)):
            return type(value)(self(v) for v in value)
        if not isinstance(value, FakeTensor):
            return value
        key = self.key(value)
        storage = self.storages.get(key)
        if storage is None:
            nbytes = value.untyped_storage().nbytes()
            storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
            self.storages[key] = storage
        meta = torch.empty(0, dtype=value.dtype, device="meta").set_(
            storage, value.storage_offset(), value.shape, value.stride()
        )
        clone = FakeTensor(value.fake_mode, meta, value.device)
        self.tensors[id(value)] = clone
        return clone

    def mapped(self, value: Any) -> Any:
        """`value` with each template tensor replaced by its copy (`eager_input_vals`)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.mapped(v) for v in value)
        if isinstance(value, dict):
            return {k: self.mapped(v) for k, v in value.items()}
        return self.tensors.get(id(value), value) if isinstance(value, torch.Tensor) else value
