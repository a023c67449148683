"""Fail fast (issue #40): one rank's failure ends its peers' dtjob collectives within seconds.

Without this, a rank that fails leaves its peers blocked in a collective until its process is
gone (its sockets close), and a process that fails may linger: atexit work (a logger uploading,
a profiler writing), a DataLoader's forked workers holding its sockets, a user's `except` that
cleans up first. Under a plain `init_process_group` the peers then wait the collective timeout
(30 minutes).

How a failure travels, under a plain process group as under `ElasticSession`:
- The failing rank (an uncaught exception: the `sys.excepthook` installed at the first dtjob
  collective on a group of several ranks; or a dtjob collective that found a peer gone) first
  writes why into the default group's store (`dtjob/abort/why`), then breaks every gloo group
  it ran dtjob collectives on: a receive posted and waited for with a 1 ms timeout makes gloo
  close every connection of the group's context (gloo's "Application timeout caused pair
  closure"; `ProcessGroup.abort()` does not unblock a gloo wait in torch 2.15: the wait lasts
  until the peer's process exits). Its own threads blocked in those groups wake too.
- A peer blocked on one of those connections gets "Connection closed by peer" at once; the dtjob
  collective turns it into `GangAborted`, which names the failed rank and its error as read from
  the store, and breaks the peer's own groups in turn: ranks blocked on that peer wake next. So
  the break cascades through the gang in milliseconds, with no polling, and a rank not in a
  collective at the time meets closed connections (then `GangAborted`) at its next one.
- A rank killed (SIGKILL, OOM) writes nothing: its sockets close, the first peer to see it breaks
  its groups and writes that a peer's connection closed, and the others learn that.

NCCL groups are left alone (their waits do not block the host; `ProcessGroup.abort()` is the tool
there, untested here without a GPU).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist

KEY_WHY = "dtjob/abort/why"
KEY_RANK = "dtjob/abort/rank"
# The tag of the receive that breaks a group: below work.py's tags (1 << 30 and up), above any
# small tag a user's own isend/irecv would use; it is never sent, only waited for 1 ms.
BREAK_TAG = (1 << 30) - 1
# How long a store read or write of the abort may take: the store is rank 0's, and a stopped
# rank 0 never answers (a store call cannot be interrupted: it runs on a thread of its own).
STORE_SECONDS = 2.0
# What gloo says once a group was broken (by this module, here or on a peer).
_BROKEN_MARKS = ("Application timeout caused pair closure", "Connection closed", "Connection reset")


class GangAborted(RuntimeError):
    """A dtjob collective ended because a rank of the gang failed. `failed_rank` is that rank when
    it said so (an exception, a signal handled), None when it vanished (killed: nothing said)."""

    def __init__(self, message: str, failed_rank: int | None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
        self.strong: list[dist.ProcessGroup] = []  # groups a torch build cannot reference weakly
        self.error: GangAborted | None = None  # set once this rank knows the gang is aborted
        self.hook_installed = False
        self.previous_hook: Callable[..., None] | None = None


_state = _State()


def register(group: dist.ProcessGroup) -> None:
    """A group dtjob's collectives run on (work.runner_for): broken on an abort. The first group of
    several ranks also installs the exception hook that aborts the gang on an uncaught error."""
    if group.size() < 2:
        return
    with _state.lock:
        try:
            _state.groups.add(group)
        except TypeError:
            _state.strong.append(group)
        if not _state.hook_installed:
            _state.hook_installed = True
            _state.previous_hook = sys.excepthook
            sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
    fail(err)
    previous = _state.previous_hook or sys.__excepthook__
    previous(kind, err, tb)


def aborted() -> GangAborted | None:
    """The error of the abort this rank knows of, or None."""
    return _state.error


def fail(err: BaseException) -> None:
    """This rank fails with `err`: tell the gang (the store), then break its groups. An error that
    is itself a peer's failure (a closed connection raised outside dtjob's collectives: torch's
    own p2p calls, say) breaks the groups too, so the ranks blocked on this one learn it."""
    if _state.error is not None:
        return
    if is_peer_failure(err):
        peer_failed(err)
        return
    rank = dist.get_rank() if dist.is_initialized() else -1
    why = f"{type(err).__name__}: {_first_line(err)}"
    _state.error = GangAborted(f"rank {rank} failed ({why})", rank)
    _publish(rank, why)
    break_groups()


def is_peer_failure(err: BaseException) -> bool:
    """Whether `err` is a collective seeing a peer gone or the gang aborted: GangAborted,
    torch.distributed's own errors, and the RuntimeErrors of gloo and NCCL ("[.../gloo/transport/
    tcp/pair.cc:561] Connection closed by peer [10.244.2.3]:19860" when a peer's process died)."""
    if isinstance(err, (GangAborted, dist.DistError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(mark in text for mark in ("gloo", "NCCL", *_BROKEN_MARKS))


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Around every dtjob collective's communication: after an abort a call fails at once, and a
    call that fails because a peer is gone raises GangAborted (and breaks this rank's groups)."""
    if _state.error is not None:
        raise _again(_state.error)
    try:
        yield
    except GangAborted:
        raise
    except RuntimeError as err:
        # Only a lost connection means a peer is gone: gloo's other errors (a size mismatch)
        # are this call's own, and keep their words.
        if _state.error is None and not _connection_lost(err):
            raise
        raise peer_failed(err) from err


def _connection_lost(err: RuntimeError) -> bool:
    return isinstance(err, dist.DistNetworkError) or any(mark in str(err) for mark in _BROKEN_MARKS)


def peer_failed(err: BaseException) -> GangAborted:
    """A collective found a peer gone (or the gang broken): the abort's error, learnt from the
    store where the failed rank wrote it; this rank's groups are broken so its peers learn it."""
    with _state.lock:
        known = _state.error
        first = known is None
        if known is None:
            known = _state.error = _read(err)
    if first:
        if known.failed_rank is None:  # nobody said why: say that a peer vanished
            _publish(-1, str(known))
        break_groups()
    return _again(known)


def _again(error: GangAborted) -> GangAborted:
    """A fresh exception of the abort (one exception object raised twice gathers tracebacks)."""
    return GangAborted(f"{error}; dtjob collectives of this process are aborted", error.failed_rank)


def break_groups() -> None:
    """Close every connection of the gloo groups dtjob ran on, and the default group's."""
    with _state.lock:
        groups = [*_state.groups, *_state.strong]
    if dist.is_initialized() and dist.group.WORLD is not None:
        groups.append(dist.group.WORLD)
    seen: set[int] = set()
    for group in groups:
        if id(group) not in seen:
            seen.add(id(group))
            _break(group)


def _break(group: dist.ProcessGroup) -> None:
    try:
        backend = group._get_backend(torch.device("cpu"))
        if "gloo" not in str(backend.name()).lower() or group.size() < 2:
            return
        peer = (group.rank() + 1) % group.size()
        work = group.recv([torch.empty(1)], peer, BREAK_TAG)
        with contextlib.suppress(RuntimeError):
            work.wait(timedelta(milliseconds=1))  # gloo closes the context's connections
    except (RuntimeError, AttributeError, ValueError):
        pass  # already broken or destroyed, or not a gloo group


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _on_thread(fn: Callable[[], object]) -> object:
    """`fn()` on a daemon thread, given up after STORE_SECONDS (None then, or on an error)."""
    box: list[object] = [None]

    def run() -> None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            box[0] = fn()

    thread = threading.Thread(target=run, name="dtjob-abort-store", daemon=True)
    thread.start()
    thread.join(STORE_SECONDS)
    return box[0]


def _publish(rank: int, why: str) -> None:
    store = _store()
    if store is None:
        return

    def write() -> None:
        if rank >= 0 or not store.check([KEY_WHY]):  # a rank's own failure says more: it wins
            store.set(KEY_RANK, str(rank))
            store.set(KEY_WHY, why)

    _on_thread(write)


def _read(err: BaseException) -> GangAborted:
    store = _store()

    def read() -> tuple[int, str] | None:
        if store is None or not store.check([KEY_WHY]):
            return None
        return int(store.get(KEY_RANK).decode()), store.get(KEY_WHY).decode()

    said = _on_thread(read)
    if isinstance(said, tuple):
        rank, why = said
        if rank >= 0:
            return GangAborted(f"rank {rank} failed ({why})", rank)
        return GangAborted(f"the gang was aborted: {why}", None)
    return GangAborted(f"a peer is gone: {_first_line(err)}", None)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


__all__ = ["GangAborted", "aborted", "break_groups", "fail", "guard", "is_peer_failure", "register"]
