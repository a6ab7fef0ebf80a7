"""``python -m partita``: the command line (see :mod:`partita.cli`)."""

from __future__ import annotations

import sys

from partita.cli import main

if __name__ == "__main__":
    sys.exit(main())
