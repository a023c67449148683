"""Auto's second opinion: time the cost model's close candidates on the caller's own calls.

The calibrated model (selection.py) ranks algorithms well where they differ by a lot and badly
where they are close: its constants scatter from one calibration to the next on a loaded host
(calibration.py). So for each kind of call - op, dtype, device and size within a power of two -
the first calls cycle through every algorithm the model puts within TRIAL_FACTOR of its best
(and whose bytes alone are within BANDWIDTH_FACTOR of it), plus the backend's own collective
("native", which the model cannot price on NCCL and which must never win by default only), in
blocks of BLOCK_CALLS calls: the first settles in, the others are timed on every rank.
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
What this module holds is plain bookkeeping; the timing and the agreement's all-reduce are the
caller's (api.py). A time may be recorded as a callable, resolved when the ranks agree: a CUDA
call's time is known only once its events have completed, and asking earlier would block.
How the constants below were chosen, with the measurements: bench/README.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dtjob.trainer.collectives.peers import whole_number_from_env
from dtjob.trainer.collectives.selection import ALGORITHMS, HIER, NATIVE, CostModel, Pods, predict

TRIALS_ENV_VAR = "DTJOB_COLLECTIVE_TRIALS"

# Each candidate runs in blocks of this many calls; the first settles in, the others are timed.
BLOCK_CALLS = 5
TIMED_PER_BLOCK = BLOCK_CALLS - 1

# Blocks per finalist: as many as the model predicts fit in TRIAL_SECONDS if every candidate ran
# them all, within [MIN_BLOCKS, MAX_BLOCKS] (16 to 48 timed calls). A small call's time jumps in
# steps of a host timer tick when a waiting vCPU halts, so small calls need many samples to rank
# right and large ones (whose ranking is steady) few; racing keeps the quality of 12 blocks each
# for about three quarters of the calls. Trials cost a kind's first calls, once: about 1 s per
# kind from 1 MiB to 16 MiB on 4 ranks, 7 s at 64 MiB.
FINALISTS = 2
TRIAL_SECONDS = 1.5
MIN_BLOCKS = 4
MAX_BLOCKS = 12

# Candidates are the algorithms predicted within this factor of the model's best. The model's
# latency term is alpha per dependent step, which makes the ring (2(n-1) steps) look 3x slower
# than rd for small messages on 4 ranks, where in a stream of calls it is often the fastest: 3.5
# times it at every size on 4 ranks, and not for small calls on 8 (14 ring steps against 3).
TRIAL_FACTOR = 3.5

# ... but only those whose bytes alone - the model's beta and gamma terms, no latency - are
# predicted within BANDWIDTH_FACTOR of the best's whole time: the model gets bytes right, latency
# wrong. rd moves the whole vector log2(n) times where the others move (n-1)/n of it twice; from
# 16 MiB on 4 ranks its bytes alone come to 1.2-1.4x the best's time, it never won a trial there
# and its blocks cost 0.5 s (16 MiB) to 2 s (64 MiB). The ring, hd and direct move the same
# bytes, so the trials still decide among them.
BANDWIDTH_FACTOR = 1.15

Seconds = float | Callable[[], float]


def trials_from_env() -> int | None:
    """DTJOB_COLLECTIVE_TRIALS: timed calls per finalist (half as many for the others), 0 = trust
    the cost model alone, None (unset) = as many as fit the time budget."""
    return whole_number_from_env(TRIALS_ENV_VAR, 0, "a whole number >= 0 (0 turns trials off)")


def candidates(
    op: str,
    nbytes: int,
    world_size: int,
    dtype_name: str,
    model: CostModel,
    available: tuple[str, ...] | None = None,
    pods: Pods | None = None,
) -> tuple[str, ...]:
    """The algorithms worth timing, cheapest predicted first (ties in ALGORITHMS order): the close
    ones among `available` (default: all of the op's, hier only with `pods`), and native whenever
    it is available."""
    order = ALGORITHMS[op]
    if available is None:
        available = tuple(a for a in order if a != HIER or pods is not None)
    predicted = {a: predict(op, a, nbytes, world_size, dtype_name, model, pods) for a in available}
    ranked = sorted(available, key=lambda a: (predicted[a], order.index(a)))
    best = predicted[ranked[0]]
    bytes_only = replace(model, alpha=0.0, overhead=0.0)

    def close(a: str) -> bool:
        light = predict(op, a, nbytes, world_size, dtype_name, bytes_only, pods) <= BANDWIDTH_FACTOR * best
        return a == NATIVE or (predicted[a] <= TRIAL_FACTOR * best and light)

    return tuple(a for a in ranked if close(a))


def blocks_per_candidate(predicted_seconds: float, timed_calls: int | None) -> int:
    """Blocks a finalist runs: enough for `timed_calls` if set, else what fits the budget when
    one call of every candidate is predicted to take `predicted_seconds` together."""
    if timed_calls is not None:
        return math.ceil(timed_calls / TIMED_PER_BLOCK)
    fit = int(TRIAL_SECONDS / (BLOCK_CALLS * predicted_seconds)) if predicted_seconds > 0 else MAX_BLOCKS
    return max(MIN_BLOCKS, min(MAX_BLOCKS, fit))


def plan(
    op: str,
    nbytes: int,
    world_size: int,
    dtype_name: str,
    model: CostModel,
    timed_calls: int | None,
    available: tuple[str, ...] | None = None,
    pods: Pods | None = None,
) -> Trials:
    """The trials of one kind of call: the model's close candidates and the blocks of a finalist."""
    found = candidates(op, nbytes, world_size, dtype_name, model, available, pods)
    together = sum(predict(op, a, nbytes, world_size, dtype_name, model, pods) for a in found)
    return Trials(found, blocks_per_candidate(together, timed_calls))


def call_kind(op: str, nbytes: int, dtype_name: str, device_type: str = "cpu") -> tuple[str, str, str, int]:
    """Calls that share a choice: same op, dtype and device type, sizes within the same power of two."""
    return op, dtype_name, device_type, nbytes.bit_length()


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
    seconds: dict[str, list[Seconds]] = field(default_factory=dict)
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

    def take(self) -> tuple[str, bool]:
        """Count the next trial call: (its candidate, whether its time is to be recorded - all but
        the first call of a block)."""
        algorithm = self.next_candidate()
        timed = (self.calls - self.round_start) % BLOCK_CALLS != 0
        self.calls += 1
        return algorithm, timed

    def add(self, algorithm: str, seconds: Seconds) -> None:
        """The time of a call take() said to record (or a callable that will tell it)."""
        self.seconds.setdefault(algorithm, []).append(seconds)

    def record(self, algorithm: str, seconds: float) -> None:
        """take() and add() at once, for a call already made with next_candidate()."""
        _, timed = self.take()
        if timed:
            self.add(algorithm, seconds)

    def ready_to_agree(self) -> bool:
        """Whether this round's calls are all made (then every rank agrees at this same call)."""
        done = self.calls - self.round_start >= BLOCK_CALLS * self.round_blocks * len(self.running)
        return self.winner is None and done

    def local_seconds(self) -> list[float]:
        """This rank's timed calls of the running candidates, in both rounds, candidate after
        candidate (what the ranks add up). Callables are resolved here, once."""
        resolved: dict[str, list[Seconds]] = {
            a: [s() if callable(s) else s for s in self.seconds.get(a, [])] for a in self.running
        }
        self.seconds.update(resolved)
        return [float(s) for a in self.running for s in resolved[a] if not callable(s)]

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
