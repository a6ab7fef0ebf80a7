"""Handlers for ops whose sharded lowering needs more than local ops: the softmax family,
vocabulary-sharded embeddings, mean, nll_loss (vocabulary-parallel too), batch norm in training
and random draws.

Each handler (``partition.handlers.Handler``) is named by a rule (``FactorRule.handler``):

=================  ==========================================================================
handler            lowering when a factor that needs it is sharded
=================  ==========================================================================
softmax_reduce     mask padding (-inf), local amax, all_reduce(max), exp, mask (0), local sum,
                   all_reduce(sum), divide (T12); backwards: one all_reduce(sum)
masked_embedding   local lookup of ``ids - tile_offset``, out-of-shard ids read row 0 and are
                   zeroed; the result is partial over the vocabulary axes (T24). Backward:
                   accumulate only this shard's rows
mean               local masked sum divided by the *global* count (a partial sum)
weighted_mean      nll_loss_forward/backward: padded targets -> ignore_index; classes split:
                   targets shifted into the local tile, the others -> a local ignore_index
                   (T26); local reduction=sum, one all_reduce of (sum, total_weight), divide
batch_stats        SyncBatchNorm: one all_reduce of per-channel (sum, sum of squares) with the
                   global count; backward: one all_reduce of (sum dy, sum dy*(x-mean))
global_random      draw the *global* random tensor (same generator state on every device, one
                   draw per program run) and keep this device's tile
index_padding      index.Tensor and the scatters with a sharded index tensor: its padding is
                   set to 0 (a valid index) before the local op
sharded_scan       cummax/cummin along a split dim: local scan, one all_gather of every tile's
                   last (value, index), combine with the extreme of the tiles before
contiguous         view_as_complex, view(dtype) of another size: the op on a contiguous copy
                   of its local tile (capture drops the program's clone)
mask_write         index_put with one boolean mask and values that broadcast without it
                   (x[mask] = v): where(mask, v, x) on each tile (vmap refuses the op)
as_strided         as_strided and its scatter (operands gathered): the op on a copy of the
                   operand laid out in the traced storage order, at the traced offset
=================  ==========================================================================

The all_reduces a handler emits are recorded in the Plan (``CollectiveRecord``) with the op,
the node and what is reduced. A few handlers change the op's factor assignment in place (the
``assign`` dict that ``Lowering`` also uses for the results' shardings): embedding_dense_backward
puts back the result-only vocabulary factor it produces locally, and weighted_mean (mean) drops
the batch factor because its results are already reduced.

Each handler is written as torch code on proxies (``partition.emit``): the maths reads as
the code, and its collectives are explicit ``e.all_reduce`` / ``e.all_gather`` calls.
Layout: ``common`` holds what the handlers read about an op (fake values, the mesh axes of an
operand dim, accumulation dtype); each other module holds one handler family:
``softmax`` (softmax_reduce), ``embedding`` (masked_embedding), ``indexing`` (index_padding),
``scan`` (sharded_scan), ``reductions`` (mean, weighted_mean), ``batchnorm`` (batch_stats),
``contiguous``, ``strided`` (as_strided) and ``random_draw`` (global_random and the
``partita::global_random_draw`` custom op).
Importing this package registers every handler.
"""

from __future__ import annotations

from partita.partition.emit import make_tuple
from partita.partition.special import (  # noqa: F401 - each registers its handler(s)
    batchnorm,
    contiguous,
    embedding,
    indexing,
    mask_write,
    random_draw,
    reductions,
    scan,
    softmax,
    strided,
)
from partita.partition.special.random_draw import global_random_draw

__all__ = ["global_random_draw", "make_tuple"]
