"""Partition handlers (see partition/handlers.py); filled in by its owner."""

from __future__ import annotations
