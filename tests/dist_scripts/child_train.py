"""``examples/train_gpt.py`` with its arguments, then whether this process imported
``torch._dynamo`` (tracing does; compiled in a child, the default under torch.distributed,
only the children trace)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_gpt import main

if __name__ == "__main__":
    main(sys.argv[1:])
    print(f"dynamo imported: {'torch._dynamo' in sys.modules}", file=sys.stderr)
