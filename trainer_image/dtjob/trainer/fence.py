"""One writer per checkpoint directory: a gang the operator replaced stops, and never publishes.

The operator replaces a gang whose node went silent by force-deleting its pods, and their
processes may live on: on a partitioned node, or under a hung kubelet, nothing kills them. A whole
gang on such a node trains on and checkpoints into the directory its successor resumes from. So
rank 0 of every gang claims the directory when the session starts: it writes `.owner` (atomically:
a temporary file renamed over it) naming the job's uid, the gang's generation and a token of its
own. From then on the gang is superseded as soon as `.owner` names anything else:

- it never publishes a checkpoint: rank 0 checks the claim right before the rename (`hold`);
- rank 0 rereads the claim every CHECK_SECONDS on a thread of its own; superseded, it logs who took
  over and exits EXIT_STALE_GENERATION (its peers follow: rank 0's store is gone, EXIT_PEER_LOST).

A gang that finds a later generation of its own job in `.owner` when it starts is stale from the
start (`StaleGenerationError`). A claim of another job is taken over, with a warning naming it:
the newest claim wins, and the other job's gang is superseded. That is meant for a job deleted and
created again over the same volume; two live jobs of one namespace never get here, because the
operator holds the younger one until the owner is done (dtjob.operator.ownership). Two namespaces
sharing one hostPath or NFS directory still do.

The check before the rename and the rename are two steps: a claim landing between them (well
under a millisecond) lets one last checkpoint of the old gang through, of the same history. Off
without the job's uid (DTJOB_JOB_UID, which the operator sets): a trainer run by hand or under
torchrun has no generations to order.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from dtjob import contract
from dtjob.trainer.elastic import StaleGenerationError

log = logging.getLogger("dtjob.trainer")

OWNER = ".owner"
# How often rank 0 rereads the claim: a superseded gang stops at most this long after its
# successor started, and reading a 150-byte file once a second costs a shared file system nothing.
CHECK_SECONDS = 1.0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("checkpoint claim %s unreadable, taken for none: %s", path, err)
        return None
    return value if isinstance(value, dict) else None


class Fence:
    """Rank 0's claim on a checkpoint directory (see the module docstring)."""

    def __init__(self, root: Path, job_uid: str, generation: int) -> None:
        self.path = root / OWNER
        self.generation = generation
        self.claim: dict[str, Any] = {
            "job_uid": job_uid,
            "generation": generation,
            "token": secrets.token_hex(8),
            "host": socket.gethostname(),
        }
        self._stop = threading.Event()

    def take(self) -> None:
        """Claim the directory; StaleGenerationError when a later generation of this job holds it."""
        held = _read(self.path)
        if held is not None and held.get("job_uid") == self.claim["job_uid"]:
            if int(held.get("generation", -1)) > self.generation:
                raise StaleGenerationError(
                    f"generation {self.generation} is stale: generation {held.get('generation')} "
                    f"of this job ({held.get('host')}) holds the checkpoint directory {self.path.parent}"
                )
        elif held is not None:
            log.warning(
                "checkpoint directory %s was claimed by job uid %s (%s); taking it over",
                self.path.parent,
                held.get("job_uid"),
                held.get("host"),
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_name(f"{OWNER}.{self.claim['token']}")
        staging.write_text(json.dumps(self.claim))
        os.replace(staging, self.path)

    def superseded(self) -> dict[str, Any] | None:
        """The claim that replaced ours, or None while ours holds. A claim gone or unreadable is
        not taken for another's (a volume briefly failing must not stop a healthy gang)."""
        held = _read(self.path)
        return held if held is not None and held != self.claim else None

    def hold(self) -> None:
        """Before publishing: exit EXIT_STALE_GENERATION if another gang claimed the directory."""
        held = self.superseded()
        if held is not None:
            self._leave(held)

    def watch(self) -> None:
        """Recheck the claim every CHECK_SECONDS on a daemon thread until `close`."""
        threading.Thread(target=self._run, name="dtjob-fence", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_SECONDS):
            self.hold()

    def _leave(self, held: dict[str, Any]) -> None:
        who = f"generation {held.get('generation')} of job uid {held.get('job_uid')} ({held.get('host')})"
        print(
            f"dtjob-trainer: superseded: {who} claimed the checkpoint directory {self.path.parent}; "
            f"generation {self.generation} stops",
            file=sys.stderr,
            flush=True,
        )
        logging.shutdown()
        os._exit(contract.EXIT_STALE_GENERATION)


def claim(root: Path | None, rank: int, generation: int) -> Fence | None:
    """Rank 0 claims `root` and watches the claim; None on other ranks, without a directory, or
    without the job's uid in the environment."""
    job_uid = contract.PodEnv.from_environ().job_uid
    if rank != 0 or root is None or not job_uid:
        return None
    fence = Fence(root, job_uid, generation)
    fence.take()
    fence.watch()
    return fence
