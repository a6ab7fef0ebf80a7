"""The type of a per-device value in handler code (``partition.emit``, ``partition.masks``).

What handler code computes with is an ``fx.Proxy`` standing for a per-device value. For the
type checker it is ``Any``: fx adds Proxy's operators (``x * 2``, ``x[i]``) at runtime, and
handler code passes proxies to ``torch.*`` functions typed for tensors, neither of which
torch's annotations can express. A module of its own so that ``masks`` (which ``emit``
imports) can name it without importing ``emit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.fx.proxy import Proxy as FxProxy

__all__ = ["FxProxy", "Proxy"]

if TYPE_CHECKING:
    Proxy = Any
else:
    Proxy = FxProxy
