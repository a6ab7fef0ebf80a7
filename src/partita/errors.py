"""The exception hierarchy of partita.

Every error partita raises on purpose is a :class:`PartitaError`. Subclasses also derive from
the built-in exception a Python user would expect (``ValueError`` for bad input,
``NotImplementedError`` for an op partita cannot shard, ``TimeoutError`` for ranks that never
join), so ``except ValueError`` keeps working in code that does not know partita.

A message has four parts: what failed (op, node, the user's source line), the values involved
(shape, spec, mesh), why, and how to fix it. User input is never checked with ``assert``.

This module defines the types, and :func:`warn`, which attributes a warning to the user's line;
it does not format messages for any particular stage.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import cast

__all__ = [
    "AnnotationError",
    "ArgumentError",
    "ArgumentTypeError",
    "AutoShardingWarning",
    "CacheEntryError",
    "CaptureError",
    "CheckpointError",
    "CompileCacheWarning",
    "CompilerError",
    "DistributedError",
    "DtypeError",
    "ExecutionError",
    "ExplicitCollectiveError",
    "HandlerCodeError",
    "ImplicitCollectiveWarning",
    "IndexRangeError",
    "InputError",
    "InternalError",
    "JitArgumentError",
    "JoinTimeoutError",
    "LaunchError",
    "MemoryLimitError",
    "MeshError",
    "MetaTensorError",
    "OptionError",
    "PartitaError",
    "PipelineError",
    "PlanMismatchError",
    "RecompileWarning",
    "RematerializationError",
    "ReplicaMismatchError",
    "ReplicationError",
    "RuleError",
    "RuleRegistrationError",
    "ShardMapError",
    "ShardMapWarning",
    "ShardingConflictError",
    "ShardingError",
    "SpecError",
    "StateDictError",
    "TrainInputError",
    "UnsupportedOpError",
    "VirtualDeviceError",
    "warn",
]


class PartitaError(Exception):
    """Base class of every error partita raises on purpose."""


class InternalError(PartitaError, RuntimeError):
    """An internal invariant of partita does not hold: a bug in partita, not in the user's
    program. The message says which check failed and ends with :attr:`REPORT`."""

    #: What every InternalError message ends with.
    REPORT = "This is a partita bug, please report it (with the code that raised it)."


class HandlerCodeError(InternalError, TypeError):
    """Partitioning handler code (``partition/emit.py`` proxies) applied an operation to a
    per-device value that the emitter cannot turn into an aten op: a bug in the handler."""


class ArgumentError(PartitaError, ValueError):
    """A partita function or class got an argument value it cannot use (a model config that
    does not divide, an unknown optimizer or preset name, an input of the wrong shape)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """A partita function or class got an argument of a type it cannot use (a mesh that is
    not a :class:`~partita.Mesh`, a module where a list of layers was expected). Also a
    ``ValueError``, as :class:`ArgumentError` is."""


class MeshError(PartitaError, ValueError):
    """A :class:`~partita.Mesh` was built from inconsistent device ids, shape or axis names."""


class OptionError(PartitaError, ValueError):
    """An option (``partita.options``: a keyword, ``using(...)`` or a ``PARTITA_*`` environment
    variable) has a value it cannot take, or no option has that name."""


class SpecError(PartitaError, ValueError):
    """A :class:`~partita.PartitionSpec` does not fit its mesh or its tensor."""


class ShardingError(PartitaError, ValueError):
    """A sharding cannot be applied to a value (wrong rank, wrong mesh, bad layout)."""


class AnnotationError(ShardingError):
    """A value already carries a different sharding annotation."""


class UnsupportedOpError(PartitaError, NotImplementedError):
    """An op in the captured program has no sharding rule."""


class RuleError(PartitaError, ValueError):
    """A sharding rule does not fit the call it was asked about: a factor spec
    (``partita.einsum_rule``) that does not parse, names the wrong number of tensors, or gives
    one factor two sizes. Propagation treats it like :class:`UnsupportedOpError` (the rule
    cannot handle this call): the op is replicated under ``replicate_unsupported=True``."""


class RuleRegistrationError(RuleError, RuntimeError):
    """A rule table cannot be built as written: ``partita.register_rule`` (or a family's
    ``RuleSet``) was asked to register a second rule for an op, or an op's ``OpFacts`` are
    declared twice or without a rule beside them."""


class ShardingConflictError(PartitaError, ValueError):
    """Annotations in one program cannot all hold (for example, two meshes in one program)."""


class RematerializationError(PartitaError, ValueError):
    """Under ``strict=True``: a reshard would need to gather the whole value on every device."""


class CaptureError(PartitaError, RuntimeError):
    """A user function could not be traced into a program."""


class ExecutionError(PartitaError, RuntimeError):
    """A per-device program failed while it ran on the simulated mesh (``LocalMesh``); the
    message names the node and the stacked shapes, and the cause is chained."""


class IndexRangeError(PartitaError, IndexError):
    """An index read by a sharded gather (``index_select``, an embedding lookup) lies outside
    the tensor it indexes."""


class PartitaWarning(UserWarning):
    """Base class of the warnings partita emits."""


class RematerializationWarning(PartitaWarning):
    """A reshard gathers a whole value on every device (an involuntary full rematerialization);
    ``strict=True`` turns it into a :class:`RematerializationError`."""


class DistributedError(PartitaError, RuntimeError):
    """A multi-process run failed: a collective broke (a peer died or timed out), or the
    processes disagree about the program or the mesh."""


class JoinTimeoutError(DistributedError, TimeoutError):
    """Some ranks never joined the run within the join timeout (``PARTITA_JOIN_TIMEOUT``)."""


class LaunchError(DistributedError, OSError):
    """A multi-process launch could not set up its network side (no port to listen on)."""


class PlanMismatchError(DistributedError):
    """The processes compiled different per-device programs (running them would deadlock)."""


class ReplicaMismatchError(DistributedError):
    """An input that must be an equal copy on several ranks (replicated over a mesh axis, such
    as a data-parallel parameter) differs between them: unseeded initialisation."""


class TrainInputError(PartitaError, ValueError):
    """A training step got input it cannot train on: a batch that is empty, of the wrong
    dtype or structure for ``batch_spec``, or a loss function that returns no scalar tensor."""


class StateDictError(PartitaError, ValueError):
    """A checkpoint given to ``TrainStep.load_state_dict`` does not fit the step (missing or
    unexpected keys, wrong shapes or dtypes); nothing was loaded."""


class CheckpointError(PartitaError, ValueError):
    """A ``partita.checkpoint`` save or load failed: a missing, truncated or changed file (its
    sha256 differs from the manifest's), a tensor whose shape, dtype or name does not match, a
    directory that is not a partita checkpoint, an ``extra`` value a load could not give back,
    processes that pass different paths or do not all call it, a save that did not complete.
    A failed save leaves a complete checkpoint at the path (the previous one); a failed load
    changes nothing."""


class RecompileWarning(PartitaWarning):
    """A jitted function compiled many distinct input signatures (``partita.jit``): something
    in its arguments (a shape, a dtype, a sharding, a static value) keeps changing."""


class CompilerError(PartitaError, RuntimeError):
    """Propagation or partitioning failed on one node for a reason that is not the user's: a
    bug in partita. The message names the op, the fx node and the user's source line, and ends
    with :attr:`WORKAROUND`."""

    #: What every CompilerError message ends with: report it, and how to get past it now.
    WORKAROUND = (
        "please report it. To get past it now, annotate around the op (mark its inputs and "
        "output replicated with partita.mark_sharding(t, mesh, P())) or set the option "
        "replicate_unsupported=True (options={'replicate_unsupported': True})."
    )


class DtypeError(PartitaError, TypeError):
    """An op of the program mixes dtypes it cannot combine (``float64 @ float32``); found when
    the program is partitioned, before anything runs."""


class InputError(PartitaError, TypeError):
    """An argument partita cannot shard (a sparse or otherwise non-strided tensor)."""


class MetaTensorError(PartitaError, RuntimeError):
    """A program lowered from meta-device tensors (a model built under
    ``torch.device("meta")``: shapes without data) was asked to run. Lowering, the Plan and its
    estimates need no data; running does."""


class ReplicatedOpWarning(PartitaWarning):
    """Under ``replicate_unsupported=True``: an op without a usable sharding rule runs on
    gathered (replicated) inputs."""


class JitArgumentError(PartitaError, TypeError, ValueError):
    """``partita.jit`` was configured with an argument it cannot use (a ``cache_limit`` below
    1, ``param_specs`` for a function that is not an ``nn.Module``)."""


class ShardMapError(PartitaError, ValueError):
    """A ``partita.shard_map`` region was set up wrongly: specs missing or not dividing the
    shapes, or a collective named over a mesh axis the region is not manual over."""


class ReplicationError(ShardMapError):
    """A shard_map ``out_specs`` calls an output replicated over a mesh axis it varies over."""


class ShardMapWarning(PartitaWarning):
    """A partially manual region's boundary costs a reshard: an auto axis does not divide a
    block the region's spec splits, so the value crosses the boundary whole over it."""


class PipelineError(PartitaError, ValueError):
    """A ``partita.pipeline`` was set up wrongly: layers that are not identical, a layer count
    or batch the stages and micro-batches do not divide, or an unknown schedule or mesh axis."""


class ExplicitCollectiveError(PartitaError, ValueError):
    """Under ``collectives="explicit"``: the partitioner would insert a collective that the
    program's annotations do not imply."""


class ImplicitCollectiveWarning(PartitaWarning):
    """Under ``collectives="warn"``: a collective the annotations do not imply was inserted."""


class VirtualDeviceError(PartitaError, RuntimeError):
    """The virtual device (``partita.use_spmd``) cannot be set up or used as asked."""


class CacheEntryError(PartitaError, ValueError):
    """An entry of the on-disk compile cache (``PARTITA_COMPILE_CACHE``) cannot be decoded
    (written by another partita or torch version, or damaged). It never reaches the user: the
    entry is refused with a :class:`CompileCacheWarning` and the step compiles again."""


class CompileCacheWarning(PartitaWarning):
    """The virtual device's on-disk compile cache was not used: its directory or a file in it
    is not private to the current user, a file names something outside the table of ops a
    cache file may call or fails its content hash, or the directory cannot be read or written.
    The step compiles (or runs) as if the cache were off; the message says what to fix."""


class MemoryLimitError(PartitaError, ValueError):
    """Auto-sharding (``memory_limit=``) found no plan whose per-device peak memory
    (``Plan.memory()``) fits the limit: the message names the smallest peak it found."""


class AutoShardingWarning(PartitaWarning):
    """Auto-sharding ran without its solver (the optional ``scipy``): the best preset, then a
    greedy pass, was chosen instead of the optimum."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str | Warning, category: type[Warning] | None = None) -> None:
    """``warnings.warn`` attributed to the user's line that called into partita.

    A fixed ``stacklevel`` points inside partita as soon as the call path changes (the compiler
    runs many frames deep); this walks out to the first frame outside the package, so the
    warning is reported, and filtered by ``-W``/``filterwarnings``, at the user's call.
    """
    level, frame = 2, cast("FrameType | None", sys._getframe(1))
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
