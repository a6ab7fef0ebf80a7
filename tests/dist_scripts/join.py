"""Join the run and report it (the join-timeout test starts only some of the ranks)."""

from __future__ import annotations

import partita.distributed as pd

pd.initialize()
print(f"joined {pd.process_index()} of {pd.process_count()}", flush=True)
pd.barrier()
