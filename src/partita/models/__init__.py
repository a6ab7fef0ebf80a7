"""Reference models for tests, examples and benchmarks.

Plain ``nn.Module`` code with no partita inside: these are the programs a user would write for
one device. ``steps`` turns a model into a functional training step that partita can trace.
This package does not shard anything.
"""

from __future__ import annotations

from partita.models.cnn import SmallCNN
from partita.models.gpt import GPT, GPTConfig
from partita.models.steps import init_opt_state, make_train_step

__all__ = ["GPT", "GPTConfig", "SmallCNN", "init_opt_state", "make_train_step"]
