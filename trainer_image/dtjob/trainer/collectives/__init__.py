"""dtjob's own collectives: Ring, Halving-Doubling and Direct built from torch.distributed p2p ops.

    from dtjob.trainer.collectives import all_reduce
    all_reduce(grad, op=ReduceOp.AVG, group=dp_group)              # cost model + timed trials choose
    all_reduce(grad, algorithm="ring")                             # or forced per call
    DTJOB_COLLECTIVE_ALGO="allreduce:hd;reduce_scatter:ring"       # or forced per op, like NCCL_ALGO
    DTJOB_COLLECTIVE_TRIALS=0                                      # auto without trials (tuning.py)

Same signatures, in-place behaviour and argument order as torch.distributed, plus the keyword
`algorithm` ("auto", "ring", "hd"; "direct" for all_reduce, reduce_scatter and all_gather; "rd"
for all_reduce; "tree" for broadcast). Works on gloo and NCCL, any group, any world size, any
length; results are bitwise identical on every rank.

On CPU tensors the reductions are torch ops, so they use torch's intra-op threads (gloo reduces
in one thread). Where ranks outnumber cores, give each rank one thread (`torch.set_num_threads(1)`
or OMP_NUM_THREADS=1, as torchrun does): 4 ranks on 2 cores at torch's default of 2 threads each
took 64 ms per 4 MiB ring all-reduce, against 12 ms with one thread (not profiled; most likely
the ranks' OpenMP threads spinning against each other).
"""

from dtjob.trainer.collectives.api import (
    all_gather_into_tensor,
    all_reduce,
    broadcast,
    calibrated_costs,
    last_algorithm,
    reduce_scatter_tensor,
)
from dtjob.trainer.collectives.selection import ALGORITHMS, ENV_VAR
from dtjob.trainer.collectives.work import CollectiveWork, forget_groups

__all__ = [
    "ALGORITHMS",
    "ENV_VAR",
    "CollectiveWork",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "calibrated_costs",
    "forget_groups",
    "last_algorithm",
    "reduce_scatter_tensor",
]
