"""Let ``torch.load`` read partita's values with its default, ``weights_only=True``.

Since PyTorch 2.6, ``torch.load`` refuses every class it does not know unless the caller passes
``weights_only=False`` (which runs arbitrary pickled code). A ``torch.save`` of a dict holding a
:class:`~partita.ShardedTensor` pickles the tensor's class, its :class:`~partita.Sharding` and
its :class:`~partita.Mesh`; registering these plain value classes here, as
``torch.distributed.tensor`` does for ``DTensor`` and ``DeviceMesh``, makes the default load
work. Nothing executable is allowed: each class is rebuilt from tensors, tuples and strings.
"""

from __future__ import annotations

import torch

from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, Sharding
from partita.values.tensor import ShardedTensor

#: The classes a pickled ShardedTensor names (checked by ``torch.serialization.
#: get_unsafe_globals_in_checkpoint`` in tests/test_serialization.py).
SAFE_GLOBALS = (Mesh, PartitionSpec, Sharding, ShardedTensor)

torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
