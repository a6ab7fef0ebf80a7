"""Reference models for tests, examples and benchmarks.

Plain ``nn.Module`` code with no partita inside: these are the programs a user would write for
one device (``GShardMoE`` may carry GShard's one annotation, ``mark_sharding``, which does
nothing when it runs eagerly). The training machinery that turns a model into a step partita
traces is :mod:`partita.training`. This package does not shard anything.
"""

from __future__ import annotations

from partita.models.cnn import SmallCNN
from partita.models.gpt import GPT, GPTConfig
from partita.models.moe import GShardMoE

__all__ = ["GPT", "GPTConfig", "GShardMoE", "SmallCNN"]
