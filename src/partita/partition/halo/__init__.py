"""The ``halo`` handler: windowed dims (convolution, pooling, constant_pad_nd) sharded along
mesh axes lower to a halo exchange with neighbours (docs/halo.md).

For one windowed dim of global input size ``n`` and output size ``m`` split into ``k`` tiles
(ceil padding: input tiles of ``c_in = ceil(n/k)``, output tiles of ``c_out = ceil(m/k)``,
aligned to the global output), device ``t`` computes outputs ``[t*c_out, (t+1)*c_out)``, whose
input window starts at ``L_t = t*c_out*s - p`` and is ``W = (c_out-1)*s + (K-1)*d + 1`` long.
Each device

1. sends its last ``Lh`` rows to its right neighbour and its first ``Rh`` rows to its left one
   (``partita::collective_permute`` over the dim's mesh axes; edge devices receive zeros), where
   ``Lh``/``Rh`` are the most *real* rows any device with real outputs needs from a neighbour;
2. concatenates ``[left halo, local tile, right halo]`` (zero-extended where a window reaches
   past it: only padding lives there) and cuts its window (a static slice when every device's
   window starts at the same place, else ``index_select`` at an ``axis_index``-based offset);
3. sets every window position outside ``[0, n)`` to the op's padding value (0, ``-inf`` for
   max pooling, the pad value for constant_pad_nd) with ``where`` - skipped when the split is
   even and the value is 0, since then those rows are already the permute's zeros;
4. runs the op with the dim's padding set to 0; the local output is exactly ``c_out`` long.

When a halo would be larger than a neighbour's tile, that dim falls back to gathering: the
operands are resharded unsplit on it, the op runs with its own padding and each result is cut
with ``shard_slice`` (made partial again where the result sums over the dim).

Backward ops (convolution_backward, max_pool2d_with_indices_backward, avg_pool2d_backward) run
on the same windows and send the halo part of the local input gradient back to its owner,
which adds it (the transpose of the exchange). ``max_pool2d_with_indices``' indices are
converted to global flat positions (so they equal the unsharded op's) and back to window
positions in the backward. avg_pool sums locally (``divisor_override=1``) and divides by the
global divisor of each output, computed from its global position. A convolution's bias is
added on one member of each group when the input channels are sharded (the result is partial).

Layout: ``geometry`` reads an op's windowed dims and plans the exchange (no graph emitted);
``exchange`` emits the collective_permutes and windows (and their transpose for gradients);
``pooling`` holds the pooling-specific pieces (indices, avg_pool divisors); ``handler`` is the
lowering of each op (conv, pooling, constant_pad_nd and their backwards) and registers it.
"""

from __future__ import annotations

from partita.partition.halo import handler  # noqa: F401 - registers the handler
from partita.partition.halo.geometry import Geo, HaloPlan, halo_plan

__all__ = ["Geo", "HaloPlan", "halo_plan"]
