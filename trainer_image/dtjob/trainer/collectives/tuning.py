"""Auto's second opinion: time the cost model's close candidates on the caller's own calls.

The calibrated model (selection.py) ranks algorithms well where they differ by a lot and badly
where they are close: on the 2-vCPU VM of bench/results its constants scatter from one calibration
to the next (calibration.py), and its pick at 1-8 MiB flipped between rd, hd and direct, once
costing a fifth of the bandwidth. So for each kind of call - op, dtype and size within a power of
two - the first calls cycle through every algorithm the model puts within TRIAL_FACTOR of its
best (and whose bytes alone are within BANDWIDTH_FACTOR of it), in blocks of BLOCK_CALLS calls:
the first settles in, the others are timed on every rank.
(A call's time includes waiting for the ranks the previous call left behind: timed right after a
call of its own, a candidate pays for the stagger it leaves itself, as it will in a stream of
calls - DDP's buckets, FSDP's layers - and not for another candidate's.) Then one small all-reduce
adds up the ranks' times call by call, so every rank holds the same numbers. With more than
FINALISTS candidates this is a race: after half their blocks the ranks agree on the FINALISTS
with the least medians, only those run the other half, and a second agreement over all their
calls keeps the winner for all later calls of that kind. (The same idea as STAR-MPI: Faraj,
Yuan and Lowenthal, "STAR-MPI: self tuned adaptive routines for MPI collective operations",
ICS 2006.)

Every trial call is a complete, correct collective; only its speed varies. Every rank goes through
the same calls in the same order, so they all reach each trial and the agreement at the same call.
What this module holds is plain bookkeeping; the agreement's all-reduce is run by the caller (api.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from dtjob.trainer.collectives.comm import whole_number_from_env
from dtjob.trainer.collectives.selection import ALGORITHMS, CostModel, predict

TRIALS_ENV_VAR = "DTJOB_COLLECTIVE_TRIALS"

# Each candidate runs in blocks of this many calls; the first settles in, the others are timed.
BLOCK_CALLS = 5
TIMED_PER_BLOCK = BLOCK_CALLS - 1

# Blocks per finalist: as many as the model predicts fit in TRIAL_SECONDS if every candidate of
# the kind ran them all, within [MIN_BLOCKS, MAX_BLOCKS] - 16 to 48 timed calls; the others run
# about half, so with four candidates the race spends about three quarters of the budget. A
# call's time here jumps in 4 ms steps when a waiting vCPU halts (bench/collectives.py), most of a
# 1 MiB call, so small calls need many samples and large ones (whose ranking is steady) few.
# Measured on sets of trials recorded with all four all-reduce algorithms timed, 4 ranks, 30 sets
# per size, each set scored by the stream time of the one it would keep (1.00 = the fastest every
# time):
#
#     blocks per candidate             1 MiB   4 KiB   4 MiB   blocks run (4 candidates)
#     3 each                           1.096   1.154   1.014   12
#     8 each (the previous rule)       1.065   1.030   1.004   32
#     12 each                          1.046   1.015   1.004   48
#     race: 2, then 1                  1.099   1.227   1.014   10
#     race: 4, then 4                  1.065   1.060   1.004   24
#     race: 6, then 6 (this rule)      1.046   1.015   1.004   36
#
# So more samples do pick better, and racing keeps that quality for three quarters of the calls.
# On older sets (24-30 per size, 8 blocks) racing 4 + 4 scored as well as 8 each at 1 MiB, 4 MiB
# and 16 MiB and better at 4 KiB (1.024 against 1.042), and 2 + 1 as well as 3 each at 16 MiB
# (1.011). The lower quartile, the median of block means and 9 calls in blocks of 2 (the rule
# before those) did no better than the median.
# From 16 MiB on 4 ranks the budget allows MIN_BLOCKS. Sets recorded there (15 at 16 MiB, 12 at
# 64 MiB, 6 blocks of every candidate, 30 draws of blocks per set): racing 2 then 1 kept a slower
# algorithm in 1.3% and 0.6% of the draws (1.0015 and 1.0003), 2 then 2 in 0.4% and 0%. The live
# bench kept direct (4-11% slower than the ring in the same run) in 5 of 56 picks at 16 and 64 MiB
# (28 runs), which these steady-state sets do not reproduce; the fourth block is cheap insurance,
# paid for by leaving rd out there (BANDWIDTH_FACTOR).
# Trials cost a kind's first calls, once. Measured on 4 ranks, two runs each: 0.6 s at 4 KiB
# (181 calls), 0.8-0.9 s at 1 MiB, 0.8-2.0 s at 4 MiB (81-181 calls: the calibration sets the
# blocks), 1.7-2.5 s at 16 MiB (51-76 calls) and 6.7-6.8 s at 64 MiB (51 calls). With rd timed
# and 3 blocks from 16 MiB (the rule before): 2.0 s and 7.2-7.4 s. At 1 MiB 12 blocks rather
# than 8 cost 0.13 s more, repaid by a 2% faster pick of a 4 ms call after ~1600 calls of the kind.
FINALISTS = 2
TRIAL_SECONDS = 1.5
MIN_BLOCKS = 4
MAX_BLOCKS = 12

# Candidates are the algorithms predicted within this factor of the model's best. The model's
# latency term is alpha per dependent step, which makes the ring (2(n-1) steps) look slow for
# small messages: under the 19 calibrations in bench/results/allreduce_world4_repeats.txt at 75244ee it
# predicts the 4-rank ring at 2.98-3.00x rd at 4 KiB and 1.35-2.47x the best at 1 MiB. Measured in
# a stream of calls the ring was the fastest at both: in the nine runs with factor 2.0, which left
# it out there, the ring alone had 1.60x native's busbw at 4 KiB against 1.33x for what auto kept,
# and 1.19x against 1.01x at 1 MiB. With 3.5 the ring is timed at every size on 4 ranks; on 8
# (14 ring steps against rd's 3) it still is not for small calls.
TRIAL_FACTOR = 3.5

# ... but only those whose bytes alone - the model's beta and gamma terms, no latency - are predicted
# within BANDWIDTH_FACTOR of the best's whole time: the model gets bytes right, latency wrong.
# rd moves the whole vector log2(n) times where the others move (n-1)/n of it twice. On 4 ranks
# its bytes alone come to 1.19-1.30x the best's time at 16 MiB and 1.31-1.38x at 64 MiB (the 10
# calibrations in bench/results/allreduce_world4_repeats.txt at 97e4b59), and it took 1.72x the
# ring's time at 16 MiB and 1.61x at 64 MiB (15 and 12 sets of 6 blocks each). It never won a
# trial there, and its two blocks (10 calls) took 0.5 s at 16 MiB and 2.0 s at 64 MiB. At 4 MiB
# its bytes come to 0.84-1.12x, so it is still timed. On 8 ranks (three doublings) they come to
# 1.42-1.76x from 16 MiB on, and 0.90-1.41x at 4 MiB, where some calibrations leave it out.
# The ring, hd and direct move the same bytes (0.85-0.99x), so the trials still decide.
BANDWIDTH_FACTOR = 1.15


def trials_from_env() -> int | None:
    """DTJOB_COLLECTIVE_TRIALS: timed calls per finalist (half as many for the others), 0 = trust
    the cost model alone, None (unset) = as many as fit the time budget."""
    return whole_number_from_env(TRIALS_ENV_VAR, 0, "a whole number >= 0 (0 turns trials off)")


def candidates(op: str, nbytes: int, world_size: int, dtype_name: str, model: CostModel) -> tuple[str, ...]:
    """The algorithms worth timing, cheapest predicted first (ties in ALGORITHMS order)."""
    predicted = {a: predict(op, a, nbytes, world_size, dtype_name, model) for a in ALGORITHMS[op]}
    ranked = sorted(ALGORITHMS[op], key=lambda a: (predicted[a], ALGORITHMS[op].index(a)))
    best = predicted[ranked[0]]
    bytes_only = replace(model, alpha=0.0, overhead=0.0)
    return tuple(
        a
        for a in ranked
        if predicted[a] <= TRIAL_FACTOR * best
        and predict(op, a, nbytes, world_size, dtype_name, bytes_only) <= BANDWIDTH_FACTOR * best
    )


def blocks_per_candidate(predicted_seconds: float, timed_calls: int | None) -> int:
    """Blocks a finalist runs: enough for `timed_calls` if set, else what fits the budget when
    one call of every candidate is predicted to take `predicted_seconds` together."""
    if timed_calls is not None:
        return math.ceil(timed_calls / TIMED_PER_BLOCK)
    fit = int(TRIAL_SECONDS / (BLOCK_CALLS * predicted_seconds)) if predicted_seconds > 0 else MAX_BLOCKS
    return max(MIN_BLOCKS, min(MAX_BLOCKS, fit))


def plan(
    op: str, nbytes: int, world_size: int, dtype_name: str, model: CostModel, timed_calls: int | None
) -> Trials:
    """The trials of one kind of call: the model's close candidates and the blocks of a finalist."""
    found = candidates(op, nbytes, world_size, dtype_name, model)
    together = sum(predict(op, a, nbytes, world_size, dtype_name, model) for a in found)
    return Trials(found, blocks_per_candidate(together, timed_calls))


def call_kind(op: str, nbytes: int, dtype_name: str) -> tuple[str, str, int]:
    """Calls that share a choice: same op and dtype, sizes within the same power of two."""
    return op, dtype_name, nbytes.bit_length()


@dataclass
class Trials:
    """One kind of call: its candidates, their timings so far, and the winner once agreed.

    A round is a turn of blocks for the candidates still running; with more than FINALISTS
    candidates (and blocks to split) the first round runs ceil(blocks / 2) of them, the second the
    rest for the finalists only. Every rank counts the same calls, so all reach each agreement at
    the same call.
    """

    candidates: tuple[str, ...]
    blocks: int  # per finalist, both rounds together; each block times TIMED_PER_BLOCK calls
    seconds: dict[str, list[float]] = field(default_factory=dict)
    winner: str | None = None
    calls: int = 0  # trial calls so far, both rounds
    running: tuple[str, ...] = ()  # the candidates taking turns in this round
    round_blocks: int = 0  # blocks each of them runs in this round
    round_start: int = 0  # trial calls made before this round

    def __post_init__(self) -> None:
        if len(self.candidates) == 1 or self.blocks == 0:
            self.winner = self.candidates[0]
            return
        self.running = self.candidates
        self.round_blocks = self.blocks if self.final_round else math.ceil(self.blocks / 2)

    @property
    def final_round(self) -> bool:
        """No race, or its second round: at most FINALISTS run, or one block cannot be split."""
        return len(self.running) <= FINALISTS or self.blocks == 1

    def next_candidate(self) -> str:
        """The candidate the next trial call runs: blocks take turns, so load drift hits all alike."""
        return self.running[(self.calls - self.round_start) // BLOCK_CALLS % len(self.running)]

    def record(self, algorithm: str, seconds: float) -> None:
        """Count a trial call; its time is kept unless it opened its block."""
        if (self.calls - self.round_start) % BLOCK_CALLS:
            self.seconds.setdefault(algorithm, []).append(seconds)
        self.calls += 1

    def ready_to_agree(self) -> bool:
        """Whether this round's calls are all made (then every rank agrees at this same call)."""
        done = self.calls - self.round_start >= BLOCK_CALLS * self.round_blocks * len(self.running)
        return self.winner is None and done

    def local_seconds(self) -> list[float]:
        """This rank's timed calls of the running candidates, in both rounds, candidate after
        candidate (what the ranks add up)."""
        return [s for a in self.running for s in self.seconds[a]]

    def agree(self, summed_seconds: list[float]) -> str | None:
        """Rank the running candidates by the median of their calls; the input is local_seconds()
        summed over the ranks, identical on every rank, so every rank ranks alike. After the first
        round of a race the FINALISTS go on (in the model's order) and this returns None; after the
        final round the least median is the winner (ties: the model's order)."""
        k = len(summed_seconds) // len(self.running)
        medians = [statistics.median(summed_seconds[i * k : (i + 1) * k]) for i in range(len(self.running))]
        ranked = sorted(range(len(self.running)), key=lambda i: (medians[i], i))
        if not self.final_round:
            self.running = tuple(self.running[i] for i in sorted(ranked[:FINALISTS]))
            self.round_start, self.round_blocks = self.calls, self.blocks - self.round_blocks
            return None
        self.winner = self.running[ranked[0]]
        return self.winner
