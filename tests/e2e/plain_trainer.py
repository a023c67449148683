"""A trainer that is not dtjob's, for the operator e2e tests: it serves no metrics and reports no
checkpoint. It exits 75 on SIGTERM (as a script honouring the elastic contract does) and 0 once
the gate file named by its argument exists, so a test decides when training ends.

    python tests/e2e/plain_trainer.py /steplog/done
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    gate = Path(argv[0])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    while not gate.exists():
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
