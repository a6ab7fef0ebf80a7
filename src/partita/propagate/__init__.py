"""Sharding propagation: give every value of a captured program a Sharding before anything runs.

The algorithm is written once, over :class:`~partita.rules.factor.FactorRule` s (Shardy-style):
for one op, every tensor that carries a factor *proposes* the mesh axes its dim gives that
factor; the op picks one assignment of mesh axes to factors; the assignment is written back to
every tensor of the op — forward into results and backward into operands alike. A worklist
repeats this to a fixpoint.

Invariants and conflict resolution (in the order they apply):

1. **User annotations are never overwritten.** The result of an annotation node is fixed to the
   user's sharding. Annotations carry a priority (0 by default; lower numbers win).
2. **Priority rounds.** Propagation runs one round per annotation priority present, lowest
   first; in round ``p`` only values derived from annotations of priority ``<= p`` propose.
   A value derived from several annotations carries the best priority among them.
3. **Pass-through ops first.** Each round first runs to a fixpoint over ops whose rule passes
   every dim through unchanged (elementwise on equal shapes, casts, transposes, annotations),
   then over all ops. So an annotation reaches its neighbours before broadcasts, matmuls and
   reshapes have to choose.
4. **Choosing one factor's axes.** Among the proposals for a factor, the best priority wins,
   then the larger tensor, then the earlier tensor (operands in order, then results).
   Need-replication and size-1 factors get no axes. One exception: when the winner is an
   operand that is a partial sum which this op alone reads, a proposal of the same priority
   that only appends axes the sum is partial over wins instead, so the sum is reduce-scattered
   onto the finer split rather than all-reduced and cut (a row-parallel matmul's result that
   an annotation wants split over batch and model: sequence parallelism's reduce_scatter).
5. **Choosing between factors that want the same mesh axis.** A mesh axis shards at most one
   factor of an op. Factors claim axes in order of best priority, then *activation first*
   (a factor some computed operand proposes beats one that only *stored* values, the
   program's inputs and their views, casts and annotations, or the results propose), then
   *support* (the total size of the tensors proposing exactly the winning axes), then first
   appearance; a factor keeps the prefix of its axes up to the first axis already taken.
   Activation first is FSDP's rule, "parameters are gathered, activations stay batch-split":
   a parameter's spec says how it is stored between steps, so when a weight split over
   ``data`` meets a batch-split activation the batch keeps ``data`` and the weight is
   gathered, however large the weight (GSPMD and Shardy also keep the data-parallel axis on
   the batch; by size alone a vocabulary-sized head weight would split the logits'
   vocabulary and the loss would move them back). Support is what makes a gradient matmul
   under FSDP reduce over the batch axis and reduce-scatter into the parameter's sharding,
   and what makes T19 (program inputs only) gather the smaller operand. Two groups claim
   late: the table of a lookup (an embedding's vocabulary and, when the table is an operand
   of its own, its columns: under FSDP the lookup follows the batch of its indices and the
   table is gathered, rather than the batch being gathered for a masked lookup or the
   embedding dim, and with it every later activation, being split), and factors only the
   results have (they are computed whole).
6. **Compound dims** (reshape): axes go to the major factor while their product divides its
   size; the minor factor gets axes only once the major factor is fully split. A factor that
   appears in a compound dim anywhere keeps only the prefix of axes whose product divides its
   size. A tensor that cannot express the op's assignment keeps what it has (the partitioner
   reshards it). A minor factor that got axes while its major factor got none hands them to
   the major factor (when its size allows) if the op's result is computed on: ``[T, B, E] ->
   [T*B, E]`` with ``B`` split becomes ``T`` split (one all_to_all) rather than a merged value
   computed whole on every device; a merge that is only the program's output stays whole.
7. **Only refinement.** A value's sharding only ever becomes more specific: each dim's axes may
   grow at the end, and a result may become partial over the axes of the op's sharded
   reduction factors if it was not partial before. Anything else is left as is and becomes a
   reshard for the partitioner. This also guarantees termination.
8. **Need-replication axes move, not vanish.** Mesh axes proposed for a factor that cannot be
   split (a sort dim, a concat dim) go to a free pass-through factor that every tensor of the op
   has (the first whose size they divide), so the partitioner moves the split to another dim
   with an all_to_all instead of gathering (XLA does the same for T21 and T25).
9. **Determinism.** Ops are visited in graph order, the worklist is FIFO without duplicates.
10. **Partial sums stay partial through linear ops.** After the fixpoint, in graph order, an op
    that ``propagate.linear`` says keeps a sum pending (``add`` of two partial sums, a view, a
    product with a replicated factor), with no split dim on any of its tensors and no other
    user of its partial operands, gets a result partial over its operands' axes, whole dims,
    and the assignment ``{}`` (``propagate.pending``): the sum is reduced once, by its users,
    not once per operand. An operand its users split (an FSDP gradient) but whose producer
    computes a whole-dims partial sum counts as that partial sum, and becomes one, where its
    sum reaches an ``add`` or ``sub`` of two sums through kept linear ops; a result
    that is a program output split by its users keeps its split.

Values nobody proposes anything for end up replicated. The result is ``node_meta.sharding(node)``
(a :class:`~partita.values.spec.Sharding`, or a tuple of them, with ``None`` for non-tensor
outputs, on
multi-output nodes) and ``node_meta.factor_axes(node)`` (the op's chosen ``{factor: mesh axes}``).

The package: the worklist and the entry point :func:`propagate` are in ``fixpoint``; the
per-value and per-op state is built in ``state``; one op's assignment is chosen in ``assign``
(invariants 4 to 8); rules are looked up in ``rules``. It does not insert collectives or
decide how to reshard; that is ``partita.partition``.
"""

from __future__ import annotations

from partita.propagate.fixpoint import propagate
from partita.propagate.rules import apply_rule, compiler_error
from partita.rules.opinfo import op_info, source_of

__all__ = ["apply_rule", "compiler_error", "op_info", "propagate", "source_of"]
