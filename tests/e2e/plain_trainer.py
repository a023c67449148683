"""A trainer that is not dtjob's, for the operator e2e tests. It exits 75 on SIGTERM (as a script
honouring the elastic contract does) and 0 once the gate file exists, so a test decides when
training ends. By default it serves no metrics and reports no checkpoint.

    python tests/e2e/plain_trainer.py GATE [--serve-step N] [--lose-rank R --after S]

--serve-step N   rank 0 serves `dtjob_trainer_step` on DTJOB_METRICS_PORT: frozen at N in
                 generation 0, advancing one a second from N in later generations.
--lose-rank R    in generation 0, rank R hangs and every other rank, after S seconds, logs the
                 peer-lost line naming R and exits 76 (what dtjob's heartbeats do).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dtjob import contract


def serve_step(port: int, frozen: bool, start: int) -> None:
    began = time.monotonic()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            step = start if frozen else start + int(time.monotonic() - began)
            body = f"# TYPE {contract.METRIC_STEP} gauge\n{contract.METRIC_STEP} {step}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("gate", type=Path)
    parser.add_argument("--serve-step", type=int)
    parser.add_argument("--lose-rank", type=int)
    parser.add_argument("--after", type=float, default=2.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(contract.EXIT_STOPPED))
    rank = int(os.environ.get(contract.ENV_RANK, "0"))
    first = os.environ.get(contract.ENV_GENERATION, "0") == "0"
    if args.serve_step is not None and rank == 0:
        serve_step(int(os.environ[contract.ENV_METRICS_PORT]), frozen=first, start=args.serve_step)
    if args.lose_rank is not None and first and rank != args.lose_rank:
        time.sleep(args.after)
        timeout = float(os.environ.get(contract.ENV_HEARTBEAT_TIMEOUT, "10"))
        print(contract.peer_lost_line(args.lose_rank, timeout), file=sys.stderr, flush=True)
        return contract.EXIT_PEER_LOST
    while not args.gate.exists():
        time.sleep(0.2)
    return contract.EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
