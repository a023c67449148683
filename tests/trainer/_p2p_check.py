"""A checker of the pipeline's point-to-point traffic, as NCCL would run it.

A trace is, per rank, the p2p operations in issue order: ("batch", [Op...]) for one
`batch_isend_irecv` call or one unbatched data send/receive (a batch of one), ("hsend", src, dst,
tag) and ("hrecv", src, dst, tag) for a header message on the CPU control group.

The model of NCCL, at its worst (tensors larger than its buffers): a rank's data operations run in
issue order, a batch's operations together; a send completes only when its receive is posted and
the other way round; the k-th send from a to b matches the k-th receive at b from a. A header send
completes at once (gloo, a few bytes); a header receive waits for its send.

`check` asserts that every data operation is in the same order on both sides (label by label) and
that running every rank's trace in this model finishes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple


class Op(NamedTuple):
    op: str  # "send" | "recv"
    peer: int
    label: Any  # what a matching operation must agree on: the message, or a tensor's shape


Item = tuple[Any, ...]


def _pair_sequences(traces: dict[int, list[Item]]) -> tuple[dict[Any, list[Any]], dict[Any, list[Any]]]:
    sends: dict[Any, list[Any]] = {}
    recvs: dict[Any, list[Any]] = {}
    for rank, items in traces.items():
        for item in items:
            if item[0] != "batch":
                continue
            for op in item[1]:
                if op.op == "send":
                    sends.setdefault((rank, op.peer), []).append(op.label)
                else:
                    recvs.setdefault((op.peer, rank), []).append(op.label)
    return sends, recvs


def check_order(traces: dict[int, list[Item]]) -> None:
    """For every ordered pair (a, b): the sends a issues to b are the receives b issues from a."""
    sends, recvs = _pair_sequences(traces)
    for pair in sorted(set(sends) | set(recvs)):
        a, b = pair
        got, want = recvs.get(pair, []), sends.get(pair, [])
        assert got == want, f"rank {a} sends {want} to rank {b}, which receives {got}"


def deadlock(traces: dict[int, list[Item]]) -> str | None:
    """Run the traces in the model above; None if every rank finishes, else where each waits."""
    pos = dict.fromkeys(traces, 0)
    posted: set[tuple[str, int, int, Any, int]] = set()  # (op, src, dst, channel, index)
    index: dict[tuple[int, int], tuple[Counter[Any], Counter[Any]]] = {}
    keys: dict[tuple[int, int], list[Any]] = {}  # (rank, item) -> its keys, numbered once
    headers_sent: Counter[tuple[int, int, int]] = Counter()
    headers_read: Counter[tuple[int, int, int]] = Counter()
    progress = True
    while progress:
        progress = False
        for rank, items in traces.items():
            while pos[rank] < len(items):
                item = items[pos[rank]]
                if item[0] == "hsend":
                    headers_sent[item[1:]] += 1
                elif item[0] == "hrecv":
                    if headers_sent[item[1:]] <= headers_read[item[1:]]:
                        break
                    headers_read[item[1:]] += 1
                else:
                    if (rank, pos[rank]) not in keys:
                        mine = []
                        for op in item[1]:
                            src, dst = (rank, op.peer) if op.op == "send" else (op.peer, rank)
                            sends, recvs = index.setdefault((src, dst), (Counter(), Counter()))
                            count = sends if op.op == "send" else recvs
                            mine.append((op.op, src, dst, "data", count["n"]))
                            count["n"] += 1
                        keys[(rank, pos[rank])] = mine
                        posted.update(mine)
                    mirror = {"send": "recv", "recv": "send"}
                    if not all((mirror[k[0]], *k[1:]) in posted for k in keys[(rank, pos[rank])]):
                        break
                pos[rank] += 1
                progress = True
    stuck = {r: traces[r][p] for r, p in pos.items() if p < len(traces[r])}
    return None if not stuck else "; ".join(f"rank {r} waits at {item}" for r, item in stuck.items())


def check(traces: dict[int, list[Item]]) -> None:
    check_order(traces)
    stuck = deadlock(traces)
    assert stuck is None, f"deadlock under NCCL: {stuck}"


# -- recording what a process really issues -------------------------------------------------------
_P2P_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_OP = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}


class Recorder:
    """Within `with Recorder() as r:`, every point-to-point call this process makes through
    torch.distributed is passed through and appended to r.calls, in issue order:
    ("batch", [(op, peer, tag, shape)...]) for a batch_isend_irecv, ("single", op, peer, tag,
    shape) for an isend/irecv/send/recv outside one. Tags >= 2**30 (dtjob's collectives) are left
    out."""

    def __init__(self) -> None:
        self.calls: list[Item] = []
        self._saved: dict[str, Any] = {}
        self._depth = 0  # calls of the spies under way

    def __enter__(self) -> Recorder:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in _P2P_NAMES:
            original = getattr(c10d, name)
            self._saved[name] = original
            spy = self._batch_spy(original) if name == "batch_isend_irecv" else self._spy(name, original)
            # Both names: P2POp checks its op against c10d's isend/irecv, which must be the spies.
            setattr(dist, name, spy)
            setattr(c10d, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, original in self._saved.items():
            setattr(dist, name, original)
            setattr(c10d, name, original)

    def _spy(self, name: str, original: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # not a call torch makes inside another (recv calls irecv)
                peer = args[1] if len(args) > 1 else None
                for key in ("dst", "src", "group_dst", "group_src"):
                    peer = kwargs.get(key) if peer is None else peer
                tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
                if tag < 2**30:
                    self.calls.append(("single", _OP[name], int(peer), int(tag), tuple(args[0].shape)))
            return self._call(original, *args, **kwargs)

        return spy

    def _batch_spy(self, original: Any) -> Any:
        def spy(ops: list[Any]) -> Any:
            if self._depth == 0:
                calls = [(self._kind(o.op), int(o.peer), int(o.tag), tuple(o.tensor.shape)) for o in ops]
                self.calls.append(("batch", calls))
            return self._call(original, ops)

        return spy

    def _call(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        self._depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            self._depth -= 1

    def _kind(self, op: Any) -> str:
        import torch.distributed.distributed_c10d as c10d

        return "send" if op is c10d.isend else "recv"


def traces_from_calls(calls: list[list[Item]]) -> tuple[dict[int, list[Item]], list[str]]:
    """Recorder.calls of every rank -> (checker traces, the data operations issued unbatched).

    Header tags become header messages; data operations are labelled with their tensor's shape;
    an unbatched data operation becomes a batch of one (NCCL runs it alone)."""
    from dtjob.trainer.parallel.pp.wire import TAG_HEADER, TAG_HEADER_LEN, TAG_TENSOR

    traces: dict[int, list[Item]] = {}
    unbatched: list[str] = []
    for rank, rank_calls in enumerate(calls):
        items: list[Item] = []
        for call in rank_calls:
            if call[0] == "batch":
                ops = call[1]
                assert all(tag == TAG_TENSOR for _, _, tag, _ in ops), f"rank {rank}: batch {ops}"
                items.append(("batch", [Op(op, peer, shape) for op, peer, _, shape in ops]))
                continue
            _, op, peer, tag, shape = call
            if tag in (TAG_HEADER_LEN, TAG_HEADER):
                items.append(("hsend", rank, peer, tag) if op == "send" else ("hrecv", peer, rank, tag))
            else:
                assert tag == TAG_TENSOR, f"rank {rank}: {call}"
                unbatched.append(f"rank {rank}: {op} {shape} {'to' if op == 'send' else 'from'} {peer}")
                items.append(("batch", [Op(op, peer, shape)]))
        traces[rank] = items
    return traces, unbatched
