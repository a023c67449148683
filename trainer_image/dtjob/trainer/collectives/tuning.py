"""Auto's second opinion: time the cost model's close candidates on the caller's own calls.

The calibrated model (selection.py) ranks algorithms well where they differ by a lot and badly
where they are close: on the 2-vCPU VM of bench/results its constants scatter from one calibration
to the next (calibration.py), and its pick at 1-8 MiB flipped between rd, hd and direct, once
costing a fifth of the bandwidth. So for each kind of call - op, dtype and size within a power of
two - the first calls cycle through every algorithm the model puts within TRIAL_FACTOR of its
best, in blocks of BLOCK_CALLS calls: the first settles in, the others are timed on every rank.
(A call's time includes waiting for the ranks the previous call left behind: timed right after a
call of its own, a candidate pays for the stagger it leaves itself, as it will in a stream of
calls - DDP's buckets, FSDP's layers - and not for another candidate's.) Then one small all-reduce
adds up the ranks' times call by call, so every rank holds the same numbers and keeps the same
winner, the least median, for all later calls of that kind. (The same idea as STAR-MPI: Faraj,
Yuan and Lowenthal, "STAR-MPI: self tuned adaptive routines for MPI collective operations",
ICS 2006.)

Every trial call is a complete, correct collective; only its speed varies. Every rank goes through
the same calls in the same order, so they all reach each trial and the agreement at the same call.
What this module holds is plain bookkeeping; the agreement's all-reduce is run by the caller (api.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from dtjob.trainer.collectives.comm import whole_number_from_env
from dtjob.trainer.collectives.selection import ALGORITHMS, CostModel, predict

TRIALS_ENV_VAR = "DTJOB_COLLECTIVE_TRIALS"

# Each candidate runs in blocks of this many calls; the first settles in, the others are timed.
BLOCK_CALLS = 5
TIMED_PER_BLOCK = BLOCK_CALLS - 1

# Blocks per candidate: as many as the model predicts fit in TRIAL_SECONDS for all candidates of
# the kind, within [MIN_BLOCKS, MAX_BLOCKS] - 12 to 32 timed calls each. A call's time here jumps
# in 4 ms steps when a waiting vCPU halts (bench/collectives.py), most of a 1 MiB call, so small
# calls need many samples and large ones (whose ranking is steady) few. Measured on 24-30 fresh
# sets of trials per size, 4 ranks, all four all-reduce algorithms timed, each set scored by the
# stream time of the one it kept (1.00 = the fastest every time): 9 timed calls in blocks of 2,
# the previous default, scored 1.10 and 1.18 at 1 MiB (two data sets). 32 timed calls in blocks
# of 5 scored 1.05 at 1 MiB (30 in blocks of 3, on the other data set: 1.12), 1.04 at 4 KiB and
# 1.01 at 4 MiB; 12 in blocks of 5 scored 1.01 at 4 MiB, and 6 in blocks of 3 1.01 at 16 MiB.
# Trials cost a kind's first calls, once; measured on 4 ranks: 0.4 s at 4 KiB (161 calls), 0.7 s
# at 1 MiB, 1.6 s at 4 MiB, 2.1 s at 16 MiB and 8.2 s at 64 MiB (61 calls; 73 with the old 9 x 2).
# Other rules replayed on the same sets (scores at 1 MiB / 4 KiB, 8 blocks): the median 1.048 /
# 1.042, the lower quartile 1.068 / 1.013, the median of block means 1.049 / 1.060. Racing (4 blocks
# each, then 4 more for the two best) scored 1.046 / 1.024 with a quarter fewer calls; not taken,
# as that saves 0.2-1.4 s per kind here (4 ranks) at the price of a second agreement round. At
# 1 MiB the misses come from noise in the calls, which no rule here removed.
TRIAL_SECONDS = 1.0
MIN_BLOCKS = 3
MAX_BLOCKS = 8

# Candidates are the algorithms predicted within this factor of the model's best. The model's
# latency term is alpha per dependent step, which makes the ring (2(n-1) steps) look slow for
# small messages: under the 19 calibrations of bench/results/allreduce_world4_repeats.txt it
# predicts the 4-rank ring at 2.98-3.00x rd at 4 KiB and 1.35-2.47x the best at 1 MiB. Measured in
# a stream of calls the ring was the fastest at both: in the nine runs with factor 2.0, which left
# it out there, the ring alone had 1.60x native's busbw at 4 KiB against 1.33x for what auto kept,
# and 1.19x against 1.01x at 1 MiB. With 3.5 the ring is timed at every size on 4 ranks; on 8
# (14 ring steps against rd's 3) it still is not for small calls.
TRIAL_FACTOR = 3.5


def trials_from_env() -> int | None:
    """DTJOB_COLLECTIVE_TRIALS: timed calls per candidate, 0 = trust the cost model alone,
    None (unset) = as many as fit the time budget."""
    return whole_number_from_env(TRIALS_ENV_VAR, 0, "a whole number >= 0 (0 turns trials off)")


def candidates(op: str, nbytes: int, world_size: int, dtype_name: str, model: CostModel) -> tuple[str, ...]:
    """The algorithms worth timing, cheapest predicted first (ties in ALGORITHMS order)."""
    predicted = {a: predict(op, a, nbytes, world_size, dtype_name, model) for a in ALGORITHMS[op]}
    ranked = sorted(ALGORITHMS[op], key=lambda a: (predicted[a], ALGORITHMS[op].index(a)))
    best = predicted[ranked[0]]
    return tuple(a for a in ranked if predicted[a] <= TRIAL_FACTOR * best)


def blocks_per_candidate(predicted_seconds: float, timed_calls: int | None) -> int:
    """Blocks each candidate runs: enough for `timed_calls` if set, else what fits the budget when
    one call of every candidate is predicted to take `predicted_seconds` together."""
    if timed_calls is not None:
        return math.ceil(timed_calls / TIMED_PER_BLOCK)
    fit = int(TRIAL_SECONDS / (BLOCK_CALLS * predicted_seconds)) if predicted_seconds > 0 else MAX_BLOCKS
    return max(MIN_BLOCKS, min(MAX_BLOCKS, fit))


def plan(
    op: str, nbytes: int, world_size: int, dtype_name: str, model: CostModel, timed_calls: int | None
) -> Trials:
    """The trials of one kind of call: the model's close candidates, each timed in enough blocks."""
    found = candidates(op, nbytes, world_size, dtype_name, model)
    together = sum(predict(op, a, nbytes, world_size, dtype_name, model) for a in found)
    return Trials(found, blocks_per_candidate(together, timed_calls))


def call_kind(op: str, nbytes: int, dtype_name: str) -> tuple[str, str, int]:
    """Calls that share a choice: same op and dtype, sizes within the same power of two."""
    return op, dtype_name, nbytes.bit_length()


@dataclass
class Trials:
    """One kind of call: its candidates, their timings so far, and the winner once agreed."""

    candidates: tuple[str, ...]
    blocks: int  # per candidate; each block times TIMED_PER_BLOCK calls
    seconds: dict[str, list[float]] = field(default_factory=dict)
    winner: str | None = None
    calls: int = 0

    def __post_init__(self) -> None:
        if len(self.candidates) == 1 or self.blocks == 0:
            self.winner = self.candidates[0]

    def next_candidate(self) -> str:
        """The candidate the next trial call runs: blocks take turns, so load drift hits all alike."""
        return self.candidates[self.calls // BLOCK_CALLS % len(self.candidates)]

    def record(self, algorithm: str, seconds: float) -> None:
        """Count a trial call; its time is kept unless it opened its block."""
        if self.calls % BLOCK_CALLS:
            self.seconds.setdefault(algorithm, []).append(seconds)
        self.calls += 1

    def ready_to_agree(self) -> bool:
        return self.winner is None and self.calls >= BLOCK_CALLS * self.blocks * len(self.candidates)

    def local_seconds(self) -> list[float]:
        """This rank's timed trial calls, candidate after candidate (what the ranks add up)."""
        return [s for a in self.candidates for s in self.seconds[a]]

    def agree(self, summed_seconds: list[float]) -> str:
        """Keep the candidate with the least median; the input is local_seconds() summed over the
        ranks, identical on every rank, so every rank keeps the same one."""
        k = self.blocks * TIMED_PER_BLOCK
        chunks = [summed_seconds[i * k : (i + 1) * k] for i in range(len(self.candidates))]
        medians = [statistics.median(chunk) for chunk in chunks]
        best = min(range(len(self.candidates)), key=lambda i: (medians[i], i))
        self.winner = self.candidates[best]
        return self.winner
