"""dtjob's own collectives: Ring, Halving-Doubling and Direct built from torch.distributed p2p ops.

    from dtjob.trainer.collectives import all_reduce
    all_reduce(grad, op=ReduceOp.AVG, group=dp_group)              # cost model + timed trials choose
    all_reduce(grad, algorithm="ring")                             # or forced per call
    all_reduce(grad, async_op=True).get_future()                   # e.g. in a DDP communication hook
    DTJOB_COLLECTIVE_ALGO="allreduce:hd;reduce_scatter:ring"       # or forced per op, like NCCL_ALGO
    DTJOB_COLLECTIVE_TRIALS=0                                      # auto without trials (tuning.py)

A drop-in for torch.distributed's four collectives: the same signatures, argument order and
in-place behaviour (broadcast's positional group_src too), the dtypes and ops torch's gloo and
NCCL take (bool, complex SUM/AVG, integer AVG as NCCL computes it; broadcast and all-gather move
any dtype), async handles with wait(), get_future() and synchronize(), and torch's exception
classes for invalid input (errors.py); a sparse tensor is refused. Plus the keyword `algorithm`:
"auto", "ring", "hd", "native" (the backend's own collective) for every op; "direct" for
all_reduce, reduce_scatter and all_gather; "rd" and "hier" (hierarchical over worker pods,
`local_world_size=` or LOCAL_WORLD_SIZE) for all_reduce; "tree" for broadcast. Works on gloo
and NCCL (coalesced p2p, stream-ordered, no host synchronization per message), any group, any
world size, any length; results are bitwise identical on every rank.

On CPU tensors the reductions are torch ops, so they use torch's intra-op threads (gloo reduces
in one thread). Where ranks outnumber cores, give each rank one thread (`torch.set_num_threads(1)`
or OMP_NUM_THREADS=1, as torchrun does): with 4 ranks on 2 cores and 2 threads each, a 4 MiB
ring all-reduce takes about 5x as long as with one thread.
"""

from dtjob.trainer.collectives.api import (
    all_gather_into_tensor,
    all_reduce,
    broadcast,
    calibrated_costs,
    last_algorithm,
    reduce_scatter_tensor,
)
from dtjob.trainer.collectives.errors import InvalidArgument, InvalidType
from dtjob.trainer.collectives.hierarchical import LOCAL_WORLD_SIZE_ENV
from dtjob.trainer.collectives.selection import ALGORITHMS, ENV_VAR
from dtjob.trainer.collectives.work import CollectiveWork

__all__ = [
    "ALGORITHMS",
    "ENV_VAR",
    "LOCAL_WORLD_SIZE_ENV",
    "CollectiveWork",
    "InvalidArgument",
    "InvalidType",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "calibrated_costs",
    "last_algorithm",
    "reduce_scatter_tensor",
]
