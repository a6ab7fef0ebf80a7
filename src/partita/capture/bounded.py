"""Data-dependent dispatch with a static bound: ``nonzero`` (and the one-argument
``torch.where``) traced as ``nonzero_static`` padded to the mask's size.

The mixture of experts most repositories write by hand routes tokens with
``tok, slot = torch.where(idx == e)`` and adds each expert's rows back with
``out.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])``: the number of rows is the
data's, so a trace on fake tensors cannot give it a shape. It has a bound the program fixes,
though: at most every element of the mask is true (tokens x top-k for ``idx == e``). While
capturing, ``nonzero(mask)`` becomes ``nonzero_static(mask, size=mask.numel(),
fill_value=-1)``: the true positions first, then rows of -1 (*padding*). Each use of the padded
indices keeps the padding out of the numbers:

* a gather by them (``x[tok]``, ``w[tok, slot]``, ``index_select``) reads row 0 for a padded
  row and yields zeros there;
* an accumulating scatter by them (``index_add``, ``index_put(accumulate=True)``,
  ``scatter_add``, the backward of the gathers) adds zeros for the padded rows;
* views that keep the rows (``select``/``unbind`` of the columns, ``unsqueeze``, ``expand``,
  ``clone``, a dtype change) stay padded indices.

The program is then static (compiled once, whatever the routing) and exact: forward values and
gradients equal eager's. Every expert runs on the bound's rows, so an expert costs as much as
a dense layer over all the tokens (the price of static shapes; GShard bounds the rows by a
capacity factor instead). Any other use of padded indices (arithmetic, a comparison, returning
them) is a CaptureError naming the op: their padding would leak into the numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.capture.source import format_source, user_frame
from partita.errors import CaptureError

__all__ = ["BoundedIndices"]

aten = torch.ops.aten

#: Views and copies whose rows are their operand's rows: padded indices in, padded indices out.
_KEEP_ROWS = frozenset(
    {
        aten.alias.default,
        aten.clone.default,
        aten.detach.default,
        aten.expand.default,
        aten.lift_fresh.default,
        aten.select.int,
        aten.slice.Tensor,
        aten.unbind.int,
        aten.unsqueeze.default,
        aten._to_copy.default,
    }
)


#: Accumulating scatters along a dim, functional and in place.
_SCATTERS = frozenset(
    {
        aten.index_add.default,
        aten.index_add_.default,
        aten.scatter_add.default,
        aten.scatter_add_.default,
    }
)


def _dim_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``dim`` argument of select/unbind/slice/unsqueeze (default 0)."""
    if len(args) > 1 and isinstance(args[1], int):
        return args[1]
    return int(kwargs.get("dim", 0))


class BoundedIndices:
    """The padded index tensors of one capture, by identity (kept alive while it lasts)."""

    def __init__(self) -> None:
        self._padded: dict[int, torch.Tensor] = {}
        self._where: dict[int, str] = {}  # a nonzero's result -> the user's line
        self._at = "an unknown line"  # the line of the padded indices in the op at hand

    def is_padded(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._padded

    def where_of(self, t: torch.Tensor) -> str:
        """The user's line of the nonzero that padded indices ``t`` come from."""
        return self._where[id(t)]

    def _mark(self, where: str, out: Any) -> Any:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._padded[id(t)] = t
                self._where[id(t)] = where
        return out

    def dispatch(self, call: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` through ``call`` (the mode's own dispatch), bounded; or
        NotImplemented when neither ``nonzero`` nor padded indices are involved."""
        if func is aten.nonzero.default:
            (x,) = args
            size = max(x.numel(), 1)
            where = format_source(user_frame()) or "an unknown line"
            return self._mark(
                where, call(aten.nonzero_static.default, (x,), {"size": size, "fill_value": -1})
            )
        flat = pytree.tree_leaves((args, kwargs))
        padded = [t for t in flat if self.is_padded(t)]
        if not padded:
            return NotImplemented
        self._at = self.where_of(padded[0])
        if func in _KEEP_ROWS:
            dim = _dim_of(func, args, kwargs)
            if func in (aten.select.int, aten.unbind.int, aten.slice.Tensor) and dim in (0, -2):
                self._refuse(func, "selects or slices the padded rows")
            return self._mark(self._at, call(func, args, kwargs))
        if func is aten.index.Tensor:
            return self._gather(call, args[0], list(args[1]))
        if func is aten.index_select.default:
            x, dim, index = args
            idx = [None] * (dim % x.ndim) + [index]
            return self._gather(call, x, idx)
        if func in _SCATTERS:
            return self._scatter(call, func, args, kwargs)
        if func in (aten.index_put.default, aten.index_put_.default):
            return self._index_put(call, func, args, kwargs)
        return self._refuse(func, "is not a gather or an accumulating scatter by them")

    # --- the uses ----------------------------------------------------------------------------

    def _valid_and_clamped(self, call: Any, index: torch.Tensor) -> tuple[Any, Any]:
        valid = call(aten.ge.Scalar, (index, 0), {})
        zero = call(aten.zeros_like.default, (index,), {})
        return valid, call(aten.where.self, (valid, index, zero), {})

    def _mask_rows(self, call: Any, x: torch.Tensor, valid: Any, dim: int) -> Any:
        """``x`` with zeros where ``valid`` (dims ``dim:dim+valid.ndim`` of ``x``) is False."""
        shape = [1] * dim + list(valid.shape) + [1] * (x.ndim - dim - valid.ndim)
        v = call(aten.view.default, (valid, shape), {})
        zero = call(aten.zeros_like.default, (x,), {})
        return call(aten.where.self, (v, x, zero), {})

    def _gather(self, call: Any, x: torch.Tensor, indices: list[Any]) -> Any:
        lead = 0
        while lead < len(indices) and indices[lead] is None:
            lead += 1
        rest = indices[lead:]
        if any(i is None for i in rest) or not rest:
            self._refuse(aten.index.Tensor, "mixes them with slices after the first index")
        valid = None
        clamped = []
        for i in rest:
            if self.is_padded(i):
                v, i = self._valid_and_clamped(call, i)
                valid = v if valid is None else call(aten.logical_and.default, (valid, v), {})
            clamped.append(i)
        if valid is None or self.is_padded(x):
            return self._refuse(aten.index.Tensor, "uses them as values, not as the index")
        out = call(aten.index.Tensor, (x, [None] * lead + clamped), {})
        return self._mask_rows(call, out, valid, lead)

    def _scatter(self, call: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self_, dim, index, src = args[:4]
        if not self.is_padded(index) or self.is_padded(self_) or self.is_padded(src):
            self._refuse(func, "uses them as values, not as the index")
        valid, clamped = self._valid_and_clamped(call, index)
        dim = dim % max(src.ndim, 1)
        if func in (aten.scatter_add.default, aten.scatter_add_.default):  # index ~ src: by element
            src = self._mask_rows(call, src, valid, 0)
        else:
            src = self._mask_rows(call, src, valid, dim)
        return call(func, (self_, dim, clamped, src, *args[4:]), kwargs)

    def _index_put(
        self, call: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self_, indices, values = args[:3]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if not accumulate:
            self._refuse(func, "writes by them without accumulate=True")
        lead = 0
        while lead < len(indices) and indices[lead] is None:
            lead += 1
        valid, clamped = None, []
        for i in indices[lead:]:
            if self.is_padded(i):
                v, i = self._valid_and_clamped(call, i)
                valid = v if valid is None else call(aten.logical_and.default, (valid, v), {})
            clamped.append(i)
        if valid is None or self.is_padded(self_) or self.is_padded(values):
            return self._refuse(func, "uses them as values, not as the index")
        n = valid.shape[0]
        shape = [*self_.shape[:lead], n, *self_.shape[lead + len(clamped) :]]
        values = call(aten.expand.default, (values, shape), {})
        values = self._mask_rows(call, values, valid, lead)
        new = [None] * lead + clamped
        return call(func, (self_, new, values, True), {})

    def refuse_results(self, outs: list[Any]) -> None:
        """Padded indices returned by the traced function would hold the padding."""
        padded = [o for o in outs if self.is_padded(o)]
        if padded:
            raise CaptureError(
                f"Cannot trace at {self.where_of(padded[0])}: the function returns the "
                "indices of a nonzero / one-argument torch.where "
                "(torch.argwhere, mask.nonzero()): their number depends on the data, and "
                "partita traces them padded to a static bound. Return torch.nonzero_static("
                "mask, size=n) (padded with fill_value), or keep the mask and use torch.where("
                "mask, a, b). This is data-dependent: a result whose shape depends on the data."
            )

    def _refuse(self, func: Any, why: str) -> Any:
        raise CaptureError(
            f"{func} gets the indices of the nonzero / one-argument torch.where at {self._at}, "
            f"which partita "
            f"traces padded to a static bound (the mask's size, rows of -1 after the true "
            f"positions), and it {why}: the padding would reach the numbers. Use the indices "
            f"only to gather (x[tok], index_select) and to add back (index_add, "
            f"index_put(accumulate=True), scatter_add), or use torch.nonzero_static(mask, "
            f"size=n) and mask the padding yourself."
        )
