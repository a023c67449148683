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
numbers. Candidates whose median is within RACE_MARGIN of the least race on: another round of
`trials` timed calls each, judged on all their calls so far (at most MAX_RACES more rounds). The
least median then wins, on every rank the same, for all later calls of that kind. (The same idea
as STAR-MPI: Faraj, Yuan and Lowenthal, "STAR-MPI: self tuned adaptive routines for MPI collective
operations", ICS 2006; the extra rounds for close calls are racing, as in irace.)

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
# (bench/collectives.py), a quarter of a 1 MiB call; the median of 5 ignores two such outliers.
DEFAULT_TRIALS = 5

# Candidates are the algorithms predicted within this factor of the model's best. Under each of
# the five calibrations in bench/results/allreduce_world4_repeats.txt (alpha 0.51-1.24 ms,
# overhead 0.34-0.50 ms), the algorithm that won the benchmark from 1 MiB up (direct or the ring)
# was a candidate, predicted within 1.5x of the best; the ring at 4 KiB, predicted at more than
# twice the best, is left out.
TRIAL_FACTOR = 2.0

# Each candidate runs in blocks of this many calls and only the last is timed (see above).
BLOCK_CALLS = 2

# Candidates within this factor of the least median race on for another round, at most MAX_RACES
# times. Why: 5 single calls can misjudge neighbours. In the 9 world-4 benchmark runs that
# recorded auto's choice (bench/results/allreduce_world4_repeats.txt, before races), the trials
# twice kept an algorithm that then ran 12-14% slower than the ring in the same run: rd at 1 MiB
# (run 4), hd at 16 MiB (run 5). A round costs per_candidate x BLOCK_CALLS calls per racer
# (0.7 s for two at 16 MiB, 4 ranks).
RACE_MARGIN = 1.10
MAX_RACES = 2


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


def most_trial_calls(candidates: int, per_candidate: int) -> int:
    """An upper bound on the calls a kind's trials take, races included."""
    return BLOCK_CALLS * per_candidate * candidates * (1 + MAX_RACES)


@dataclass
class Trials:
    """One kind of call: its candidates, their timings so far, and the winner once agreed."""

    candidates: tuple[str, ...]
    per_candidate: int
    seconds: dict[str, list[float]] = field(default_factory=dict)  # this rank's, this round
    winner: str | None = None
    calls: int = 0  # this round's
    rounds: list[tuple[str, ...]] = field(default_factory=list)  # who took turns, round by round
    agreed: dict[str, list[float]] = field(default_factory=dict)  # the ranks' summed times so far

    def __post_init__(self) -> None:
        if len(self.candidates) == 1 or self.per_candidate == 0:
            self.winner = self.candidates[0]
        else:
            self.rounds.append(self.candidates)

    @property
    def racing(self) -> tuple[str, ...]:
        """The candidates timed in the current round."""
        return self.rounds[-1]

    def next_candidate(self) -> str:
        """The candidate the next trial call runs: blocks take turns, so load drift hits all alike."""
        return self.racing[self.calls // BLOCK_CALLS % len(self.racing)]

    def record(self, algorithm: str, seconds: float) -> None:
        """Count a trial call; its time is kept if it is the last of its block."""
        self.calls += 1
        if self.calls % BLOCK_CALLS == 0:
            self.seconds.setdefault(algorithm, []).append(seconds)

    def ready_to_agree(self) -> bool:
        return self.winner is None and self.calls >= BLOCK_CALLS * self.per_candidate * len(self.racing)

    def local_seconds(self) -> list[float]:
        """This rank's timed calls of the round, candidate after candidate (what the ranks add up)."""
        return [s for a in self.racing for s in self.seconds[a][: self.per_candidate]]

    def agree(self, summed_seconds: list[float]) -> str | None:
        """Judge the round: the input is local_seconds() summed over the ranks, identical on every
        rank, so every rank makes the same decision. Returns the winner, or None while the close
        candidates race on for another round."""
        k = self.per_candidate
        for i, algorithm in enumerate(self.racing):
            self.agreed.setdefault(algorithm, []).extend(summed_seconds[i * k : (i + 1) * k])
        medians = {a: statistics.median(self.agreed[a]) for a in self.racing}
        order = self.candidates.index  # ties go to the model's order
        best = min(self.racing, key=lambda a: (medians[a], order(a)))
        close = tuple(a for a in self.racing if medians[a] <= RACE_MARGIN * medians[best])
        self.seconds, self.calls = {}, 0
        if len(close) > 1 and len(self.rounds) <= MAX_RACES:
            self.rounds.append(close)
            return None
        self.winner = best
        return best
