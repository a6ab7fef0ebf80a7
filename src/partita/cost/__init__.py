"""The cost model: how long collectives, local ops and a step take on named hardware.

Pure values and pure functions (:mod:`partita.cost.model`: hardware profiles, alpha-beta times
per collective and mesh axis, the roofline of one op; :mod:`partita.cost.flops`: the FLOPs and
bytes of an fx node from its shapes; :mod:`partita.cost.copies`: the local copies the runtime
makes around each collective call). Nothing here traces, partitions or runs a program; the
step-time estimate of a Plan and the auto-sharding solver build on these.
"""

from __future__ import annotations

from partita.cost.flops import node_bytes, node_flops
from partita.cost.model import (
    PROFILES,
    Hardware,
    Link,
    collective_time,
    get_profile,
    link_of,
    op_time,
    wire_bytes,
)

__all__ = [
    "PROFILES",
    "Hardware",
    "Link",
    "collective_time",
    "get_profile",
    "link_of",
    "node_bytes",
    "node_flops",
    "op_time",
    "wire_bytes",
]
