"""Which algorithm runs a call: explicit keyword > DTJOB_COLLECTIVE_ALGO > alpha-beta-gamma cost model.

(With trials on, the model proposes and tuning.py times its close candidates on real calls,
always with the backend's own collective, "native", among them.)

The cost model (Hockney's alpha-beta plus a gamma term for reduction, as in Thakur, Rabenseifner
and Gropp, "Optimization of collective communication operations in MPICH", 2005):

    alpha     seconds per dependent step: one exchange of a small message with one peer (wire
              latency plus our per-message Python and wake-up overhead)
    beta      seconds per byte moved over one link
    gamma     seconds per byte reduced, per dtype (bfloat16 adds are much slower than float32 on CPU)
    overhead  seconds each further message pair costs when a step posts several at once (LogP's o):
              what the direct algorithm pays instead of the ring's extra alphas

The pipelined algorithms cut each region into segments (peers.segments_for); each costs one alpha.
"native" is priced as what torch's gloo runs (a ring all-reduce; reduce-scatter = that all-reduce,
then a copy; a ring all-gather; a tree broadcast); on NCCL the model is not asked about it (api.py).
"hier" is priced with the same alpha and beta inside and across pods: the model cannot see the
faster links inside a pod, only hier's fewer dependent steps; the trials see the links.
The constants are measured on the running group (calibration.py) and then identical on every rank,
so every rank makes the same choice - a different choice on two ranks would deadlock.
Everything in this module is a pure function of its arguments.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from dtjob.trainer.collectives.peers import segments_for

ENV_VAR = "DTJOB_COLLECTIVE_ALGO"

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "hd", "rd", "direct", "hier", "native"),
    "reduce_scatter": ("ring", "hd", "direct", "native"),
    "allgather": ("ring", "hd", "direct", "native"),
    "broadcast": ("tree", "ring", "hd", "native"),
}
NATIVE = "native"
HIER = "hier"
# (pods, members per pod) of a group the hierarchical all-reduce applies to (hierarchical.py).
Pods = tuple[int, int]

_ALIASES = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "reduce_scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allgather": "allgather",
    "all_gather": "allgather",
    "all_gather_into_tensor": "allgather",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class CostModel:
    alpha: float
    beta: float
    gamma: dict[str, float] = field(default_factory=dict)  # dtype name ("float32") -> s/byte
    overhead: float = 0.0

    def gamma_for(self, dtype_name: str) -> float:
        if dtype_name in self.gamma:
            return self.gamma[dtype_name]
        return max(self.gamma.values(), default=self.beta)


# Used when nothing was measured yet (unit tests, one rank): loopback TCP on one host, ~60 us per
# exchange through Python, ~2.5 GB/s per link, ~4 GB/s float32 adds, ~40 us per further message
# posted in the same step.
DEFAULT_COSTS = CostModel(alpha=60e-6, beta=0.4e-9, gamma={"float32": 0.25e-9}, overhead=40e-6)


def _fold(n: int) -> tuple[int, int]:
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def _move(m: CostModel, nbytes: float, segmented: bool = True) -> float:
    """One message of nbytes over one link (cut into segments when `segmented`)."""
    messages = segments_for(nbytes) if segmented else 1
    return messages * m.alpha + nbytes * m.beta


def _halving(m: CostModel, p: int, nbytes: float, gamma: float) -> float:
    total, size = 0.0, nbytes
    while size * p > nbytes and p > 1:  # log2(p) steps, each half the previous one
        size /= 2
        total += _move(m, size) + size * gamma
    return total


def _direct_phase(m: CostModel, n: int, chunk: float) -> float:
    """n-1 chunks to n-1 peers at once: one step's latency, n-2 further message pairs, and the
    n-1 chunks through this rank's link one after another (the ring moves the same bytes)."""
    return m.alpha + (n - 2) * m.overhead + (n - 1) * chunk * m.beta


def _hier(m: CostModel, pods: Pods, nbytes: float, gamma: float) -> float:
    """Ring reduce-scatter inside the pod, ring all-reduce of a k-th across pods, ring all-gather."""
    count, k = pods
    part = nbytes / k
    inside = (k - 1) * (2 * _move(m, part) + part * gamma)  # reduce-scatter and all-gather
    across = 2 * (count - 1) * _move(m, part / count) + (count - 1) * (part / count) * gamma
    return inside + across


def predict(
    op: str,
    algorithm: str,
    nbytes: int,
    world_size: int,
    dtype_name: str,
    m: CostModel,
    pods: Pods | None = None,
) -> float:
    """Predicted seconds of one call of `op` with `algorithm` on `nbytes` (the full vector);
    "hier" needs the group's `pods`."""
    n = world_size
    if n == 1 or nbytes == 0:
        return 0.0
    if algorithm == NATIVE:  # what torch's gloo runs
        shape = {"allreduce": "ring", "reduce_scatter": "ring", "allgather": "ring", "broadcast": "tree"}
        as_op = "allreduce" if op == "reduce_scatter" else op
        if op in shape:
            return predict(as_op, shape[op], nbytes, n, dtype_name, m)
    if algorithm == HIER and op == "allreduce":
        if pods is None:
            raise ValueError("the hierarchical all-reduce's cost needs the group's pods")
        return _hier(m, pods, nbytes, m.gamma_for(dtype_name))
    g = m.gamma_for(dtype_name)
    chunk = nbytes / n
    p, extra = _fold(n)
    log_p = int(math.log2(p))
    fold_reduce = (_move(m, nbytes) + nbytes * g) if extra else 0.0
    if op == "allreduce":
        if algorithm == "ring":
            return 2 * (n - 1) * _move(m, chunk) + (n - 1) * chunk * g
        if algorithm == "hd":
            return (
                fold_reduce
                + _halving(m, p, nbytes, g)
                + _halving(m, p, nbytes, 0.0)
                + (_move(m, nbytes) if extra else 0.0)
            )
        if algorithm == "rd":
            return (
                fold_reduce
                + log_p * (_move(m, nbytes, False) + nbytes * g)
                + (_move(m, nbytes, False) if extra else 0.0)
            )
        if algorithm == "direct":
            return 2 * _direct_phase(m, n, chunk) + (n - 1) * chunk * g
    if op == "reduce_scatter":
        if algorithm == "ring":
            return (n - 1) * (_move(m, chunk) + chunk * g)
        if algorithm == "direct":
            return _direct_phase(m, n, chunk) + (n - 1) * chunk * g
        if algorithm == "hd":
            return fold_reduce + _halving(m, p, nbytes, g) + (_move(m, chunk) if extra else 0.0)
    if op == "allgather":
        if algorithm == "ring":
            return (n - 1) * _move(m, chunk)
        if algorithm == "direct":
            return _direct_phase(m, n, chunk)
        if algorithm == "hd":
            return (
                (_move(m, chunk) if extra else 0.0)
                + _halving(m, p, nbytes, 0.0)
                + (_move(m, nbytes) if extra else 0.0)
            )
    if op == "broadcast":
        if algorithm == "tree":
            return math.ceil(math.log2(n)) * _move(m, nbytes, False)
        scatter = (n - 1) * _move(m, chunk, False)  # the root's sends share its link
        if algorithm == "ring":
            return scatter + predict("allgather", "ring", nbytes, n, dtype_name, m)
        if algorithm == "hd":
            return scatter + predict("allgather", "hd", nbytes, n, dtype_name, m)
    raise ValueError(f"no cost formula for op={op!r} algorithm={algorithm!r}")


def choose(
    op: str,
    nbytes: int,
    world_size: int,
    dtype_name: str,
    m: CostModel,
    available: tuple[str, ...] | None = None,
    pods: Pods | None = None,
) -> str:
    """The cheapest of the `available` algorithms (default: all of `op`'s, hier only with `pods`);
    ties go to the first in ALGORITHMS[op]."""
    order = ALGORITHMS[op]
    if available is None:
        available = tuple(a for a in order if a != HIER or pods is not None)
    return min(
        available,
        key=lambda a: (predict(op, a, nbytes, world_size, dtype_name, m, pods), order.index(a)),
    )


def parse_override(text: str) -> dict[str, str]:
    """Parse DTJOB_COLLECTIVE_ALGO, e.g. "allreduce:hd;reduce_scatter:ring" or just "ring".

    A bare name applies to every op that has an algorithm of that name. Op names accept torch's
    spellings too (all_reduce, reduce_scatter_tensor, all_gather_into_tensor).
    """
    choices: dict[str, str] = {}
    for raw in text.replace(",", ";").split(";"):
        item = raw.strip().lower()
        if not item:
            continue
        if ":" not in item:
            if not any(item in algos for algos in ALGORITHMS.values()):
                valid = sorted({a for algos in ALGORITHMS.values() for a in algos})
                raise ValueError(f"{ENV_VAR}: unknown algorithm {item!r}; expected one of {valid}")
            for op, algos in ALGORITHMS.items():
                if item in algos:
                    choices[op] = item
            continue
        op_name, _, algo = (part.strip() for part in item.partition(":"))
        canonical = _ALIASES.get(op_name)
        if canonical is None:
            raise ValueError(
                f"{ENV_VAR}: unknown collective {op_name!r} in {raw.strip()!r}; "
                f"expected one of {sorted(ALGORITHMS)}"
            )
        if algo not in ALGORITHMS[canonical] and algo != "auto":
            valid_here = [*ALGORITHMS[canonical], "auto"]
            raise ValueError(
                f"{ENV_VAR}: {canonical} has no algorithm {algo!r}; expected one of {valid_here}"
            )
        if algo != "auto":
            choices[canonical] = algo
    return choices


_parsed: tuple[str, dict[str, str]] = ("", {})


def env_override(op: str) -> str | None:
    """The algorithm DTJOB_COLLECTIVE_ALGO forces for `op`, if any (parsed once per value)."""
    global _parsed
    text = os.environ.get(ENV_VAR, "")
    if text != _parsed[0]:
        _parsed = (text, parse_override(text))
    forced: str | None = _parsed[1].get(op)
    return forced


def validate_keyword(op: str, algorithm: str) -> None:
    if algorithm != "auto" and algorithm not in ALGORITHMS[op]:
        raise ValueError(
            f"algorithm={algorithm!r} is not valid for {op}; use one of {['auto', *ALGORITHMS[op]]}"
        )
