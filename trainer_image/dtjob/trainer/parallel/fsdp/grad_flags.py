"""Which parameters got a gradient, agreed by every rank: no gradient stays no gradient.

A torch optimizer skips a parameter whose `.grad` is None (AdamW neither decays it nor moves its
moments), so a parameter that got no gradient on any rank (unused in the forward, an MoE expert
that got no tokens) must keep `.grad = None` on every rank's shard piece, as in one process. Its
reduction cannot simply be skipped: a unit's reduce-scatter may start during backward, before
every rank knows what the others used, and a parameter used on some ranks only is reduced as DDP
does (the sum over ranks / world; a rank without a gradient adds zeros).

So every unit is reduced as before (the zeros of the unused are added exactly), and:
  - `mark(i)`: the post-accumulate-grad hook of slot i fired (this rank has its gradient);
  - `note(unit)`: just before a unit's reduced shard is added, which pieces had `.grad` None
    (since zero_grad(set_to_none=True); an earlier micro-step's gradient is kept, not None);
  - `launch()`: after the last unit's reduce-scatter is launched, one all-reduce of one float32
    flag per parameter (4 bytes each: 400 bytes for 100 parameters), in the same place of every
    rank's sequence of collectives, overlapped with the reductions still in flight;
  - `apply()`: a noted piece whose parameter no rank marked goes back to `.grad = None`.
The flags are read on the host (a device sync) only where this rank has such a piece whose
parameter it did not mark itself; otherwise the result cannot turn anything back to None.
"""

from __future__ import annotations

import torch

from dtjob.trainer.parallel.comm import Comm, Handle
from dtjob.trainer.parallel.fsdp.flat import FlatUnit


class GradFlags:
    def __init__(self, units: list[FlatUnit], comm: Comm) -> None:
        self.comm = comm
        self.base: dict[int, int] = {}  # unit index -> its first slot's flag
        count = 0
        for unit in units:
            self.base[unit.index] = count
            count += len(unit.slots)
        self.local = [False] * count  # this rank got the slot's gradient since the flags were last sent
        self.flags = torch.zeros(count, dtype=torch.float32, device=units[0].device)
        self._noted: list[tuple[FlatUnit, int]] = []  # (unit, piece position): .grad was None
        self._handle: Handle | None = None

    def mark(self, unit: FlatUnit, slot: int) -> None:
        self.local[self.base[unit.index] + slot] = True

    def note(self, unit: FlatUnit) -> None:
        """Call before adding the unit's reduced shard to its pieces' gradients."""
        for i, piece in enumerate(unit.pieces):
            if piece.param.grad is None:
                self._noted.append((unit, i))

    def launch(self) -> None:
        if all(self.local):  # the usual case: a device-side fill, no copy from the host
            self.flags.fill_(1.0)
        else:
            self.flags.copy_(torch.tensor(self.local, dtype=torch.float32))
        self._handle = self.comm.all_reduce_sum(self.flags, async_op=True)

    def apply(self) -> None:
        """Wait for the flags; pieces noted whose parameter no rank marked get `.grad = None`."""
        assert self._handle is not None, "GradFlags.apply() without launch()"
        self._handle.wait()
        self._handle = None
        unmarked = [(u, i) for u, i in self._noted if not self.local[self.base[u.index] + i]]
        if unmarked:
            used = self.flags.tolist()
            for unit, i in unmarked:
                if used[self.base[unit.index] + i] == 0:
                    unit.pieces[i].param.grad = None
        self._noted.clear()
        self.local = [False] * len(self.local)
