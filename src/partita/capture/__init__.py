"""Capture: trace a user function into a functional fx graph of aten ops (a Program)."""

from __future__ import annotations

from partita.capture import ops
from partita.capture.decompositions import KEPT_OPS, decomposition_table

__all__ = ["KEPT_OPS", "decomposition_table", "ops"]
