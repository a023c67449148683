"""Auto's second opinion: time the cost model's close candidates on the caller's own calls.

The calibrated model (selection.py) ranks algorithms well where they differ by a lot and badly
where they are close: on the 2-vCPU VM of bench/results its constants scatter from one calibration
to the next (calibration.py), and its pick at 1-8 MiB flipped between rd, hd and direct, once
costing a fifth of the bandwidth. So for each kind of call - op, dtype and size within a power of
two - the first calls cycle through every algorithm the model puts within TRIAL_FACTOR of its
best, in blocks of two calls: the first settles in, the second is timed on every rank, `trials`
timed calls per candidate. (A call's time includes waiting for the ranks the previous call left
behind: timed right after a call of its own, a candidate pays for the stagger it leaves itself, as
it will in a stream of calls - DDP's buckets, FSDP's layers - and not for another candidate's.)
Then one small all-reduce adds up the ranks' times call by call, so every rank holds the same
numbers and keeps the same winner, the least median, for all later calls of that kind. (The same
idea as STAR-MPI: Faraj, Yuan and Lowenthal, "STAR-MPI: self tuned adaptive routines for MPI
collective operations", ICS 2006.)

Every trial call is a complete, correct collective; only its speed varies. Every rank goes through
the same calls in the same order, so they all reach each trial and the agreement at the same call.
What this module holds is plain bookkeeping; the agreement's all-reduce is run by the caller (api.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dtjob.trainer.collectives.comm import whole_number_from_env
from dtjob.trainer.collectives.selection import ALGORITHMS, CostModel, predict

TRIALS_ENV_VAR = "DTJOB_COLLECTIVE_TRIALS"

# Timed calls per candidate. A call's time here jumps in 4 ms steps when a waiting vCPU halts
# (bench/collectives.py), most of a 1 MiB call; the median of 9 ignores four such outliers. With 5,
# at 4 KiB on 4 ranks, 30 fresh trials kept hd 8 times (rd, 1.4x as fast in a stream of calls,
# 19 times); with 9, hd 2 times and rd 23. The trials cost only a kind's first calls:
# BLOCK_CALLS x 9 per candidate.
DEFAULT_TRIALS = 9

# Candidates are the algorithms predicted within this factor of the model's best. Under the nine
# calibrations in bench/results/allreduce_world4_repeats.txt (alpha 0.41-0.91 ms, overhead
# 0.005-0.39 ms) the ring, the benchmark's fastest from 1 MiB up, is predicted at 1.02-1.31x the
# best from 16 MiB up and at 1.12-1.83x at 4 MiB: always a candidate. At 1 MiB it is predicted at
# 1.48-2.47x and was left out in three runs: there auto kept rd twice (1.13x and 1.12x native,
# where the ring alone measured 1.22x and 1.43x) and direct once (0.99x; the ring 1.30x). At
# 4 KiB it is predicted at 3x and left out.
TRIAL_FACTOR = 2.0

# Each candidate runs in blocks of this many calls and only the last is timed (see above).
BLOCK_CALLS = 2


def trials_from_env() -> int:
    """DTJOB_COLLECTIVE_TRIALS: timed calls per candidate (0 = trust the cost model alone)."""
    value = whole_number_from_env(TRIALS_ENV_VAR, 0, "a whole number >= 0 (0 turns trials off)")
    return DEFAULT_TRIALS if value is None else value


def candidates(op: str, nbytes: int, world_size: int, dtype_name: str, model: CostModel) -> tuple[str, ...]:
    """The algorithms worth timing, cheapest predicted first (ties in ALGORITHMS order)."""
    predicted = {a: predict(op, a, nbytes, world_size, dtype_name, model) for a in ALGORITHMS[op]}
    ranked = sorted(ALGORITHMS[op], key=lambda a: (predicted[a], ALGORITHMS[op].index(a)))
    best = predicted[ranked[0]]
    return tuple(a for a in ranked if predicted[a] <= TRIAL_FACTOR * best)


def call_kind(op: str, nbytes: int, dtype_name: str) -> tuple[str, str, int]:
    """Calls that share a choice: same op and dtype, sizes within the same power of two."""
    return op, dtype_name, nbytes.bit_length()


@dataclass
class Trials:
    """One kind of call: its candidates, their timings so far, and the winner once agreed."""

    candidates: tuple[str, ...]
    per_candidate: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    winner: str | None = None
    calls: int = 0

    def __post_init__(self) -> None:
        if len(self.candidates) == 1 or self.per_candidate == 0:
            self.winner = self.candidates[0]

    def next_candidate(self) -> str:
        """The candidate the next trial call runs: blocks take turns, so load drift hits all alike."""
        return self.candidates[self.calls // BLOCK_CALLS % len(self.candidates)]

    def record(self, algorithm: str, seconds: float) -> None:
        """Count a trial call; its time is kept if it is the last of its block."""
        self.calls += 1
        if self.calls % BLOCK_CALLS == 0:
            self.seconds.setdefault(algorithm, []).append(seconds)

    def ready_to_agree(self) -> bool:
        return self.winner is None and self.calls >= BLOCK_CALLS * self.per_candidate * len(self.candidates)

    def local_seconds(self) -> list[float]:
        """This rank's timed trial calls, candidate after candidate (what the ranks add up)."""
        return [s for a in self.candidates for s in self.seconds[a][: self.per_candidate]]

    def agree(self, summed_seconds: list[float]) -> str:
        """Keep the candidate with the least median; the input is local_seconds() summed over the
        ranks, identical on every rank, so every rank keeps the same one."""
        k = self.per_candidate
        chunks = [summed_seconds[i * k : (i + 1) * k] for i in range(len(self.candidates))]
        medians = [statistics.median(chunk) for chunk in chunks]
        best = min(range(len(self.candidates)), key=lambda i: (medians[i], i))
        self.winner = self.candidates[best]
        return self.winner
