"""Recovery from the gang's memory (snapshots written by snapshot.py), before any durable checkpoint.

Every rank of the new gang lists the complete rank files in its pod's snapshot directory (its own,
the buddy copies it holds, and its pod-mates': they share the directory), and the ranks all-gather
that inventory. They pick the newest step, at or after the newest durable checkpoint, for which every
rank file of that step's world is held by some rank. Each rank then works out which files its
own shards need (the ranges `TrainState.load` will read, from the manifest built out of the files'
indexes), the ranks fetch the files they lack from holders point-to-point over a gloo group, into
a per-rank staging directory, and load through the checkpoint's own reader (`ShardReader`): the
state reshards to a new world size exactly as a durable checkpoint does. The scheduler's and the
user's values (rank 0's file) are broadcast by one holder, so no rank fetches rank 0's shards only
for them.

When no such step exists but newer snapshots do, `recover` says which shards each lost, and the
caller falls back to the durable checkpoint. So does a fetched file whose sha256 is not its info's
(damaged memory): every rank checks its files, and any damage sends every rank to the checkpoint
(the snapshots are deleted, so the next restart does not meet them again).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtjob.trainer.checkpoint import (
    MANIFEST,
    Loaded,
    RankFileInfo,
    ShardReader,
    build_manifest,
    list_step_dirs,
    rank_file_name,
    restore_rng_state,
    step_dir_name,
)
from dtjob.trainer.parallel.comm import control_group
from dtjob.trainer.parallel.shards import local_tensor
from dtjob.trainer.snapshot import Snapshots, inventory, prune
from dtjob.trainer.train_state import TrainState, local_shards_of

log = logging.getLogger("dtjob.trainer.snapshot")

Holders = dict[tuple[int, int], list[int]]  # (step, owner rank) -> ranks that hold its file


def newest_durable_step(root: Path | None) -> int:
    """The newest checkpoint step with a manifest (0: none). Not verified: a corrupt newest one only
    makes the memory's bar higher than it needs to be."""
    if root is None:
        return 0
    return next((step for step, d in list_step_dirs(root) if (d / MANIFEST).is_file()), 0)


def choose(
    held: list[list[dict[str, Any]]], durable: int
) -> tuple[int | None, dict[int, dict[str, Any]], Holders, list[str]]:
    """From every rank's inventory: the newest complete step at or after `durable` (None: none),
    its files' infos by owner, who holds each file, and for each such incomplete step what it lost.
    At the durable checkpoint's own step memory wins: no disk read, and a damaged checkpoint file
    (the chaos soak's) costs nothing, where it sent the gang 9 steps back to the one before."""
    holders: Holders = {}
    infos: dict[tuple[int, int], dict[str, Any]] = {}
    for rank, items in enumerate(held):
        for info in items:
            key = (int(info["step"]), int(info["owner"]))
            holders.setdefault(key, []).append(rank)
            infos.setdefault(key, info)
    lost: list[str] = []
    for step in sorted({s for s, _ in infos if s >= durable}, reverse=True):
        owners = {o: infos[(step, o)] for s, o in infos if s == step}
        worlds = {int(i["meta"]["world_size"]) for i in owners.values()}
        world = max(worlds)
        missing = [o for o in range(world) if o not in owners]
        if len(worlds) == 1 and not missing:
            return step, owners, holders, lost
        lost.append(
            f"the snapshot of step {step} lost shards {', '.join(map(str, missing)) or '(mixed worlds)'}"
        )
    return None, {}, holders, lost


def needed_files(state: TrainState, manifest: Mapping[str, Any], rank: int) -> set[str]:
    """The files holding the ranges `TrainState.load` reads on this rank (and its own file, for its
    random state, at the same world size)."""
    params, buffers = local_shards_of(state.model)
    tensor_states = manifest["extra_state"].get("tensor_states", []) if state.optimizer is not None else []
    ranges = [(f"model.{s.name}", s.offset, local_tensor(s.tensor).numel()) for s in [*params, *buffers]]
    ranges += [
        (f"optim.{s.name}.{k}", s.offset, local_tensor(s.tensor).numel())
        for s in params
        for k in tensor_states
    ]
    files: set[str] = set()
    for key, start, length in ranges:
        spec = manifest["tensors"].get(key)
        if spec is None:
            continue  # ShardReader.fetch names the missing tensor
        for name, offset, count in spec["shards"]:
            if max(start, offset) < min(start + length, offset + count):
                files.add(name)
    if int(manifest["world_size"]) == dist.get_world_size():
        files.add(rank_file_name(rank))
    return files


def _fetch(
    snaps: Snapshots,
    step: int,
    infos: dict[int, dict[str, Any]],
    holders: Holders,
    needs: list[list[str]],
    staging: Path,
) -> None:
    """Every rank's needed files into its staging directory: linked where its pod holds them,
    else sent by a holder (the k-th needer of a file takes the k-th holder, round robin). The
    transfers run in one global order, so each pair's send and receive meet without deadlock."""
    rank = snaps.rank
    own_dir = snaps.root / step_dir_name(step)
    by_name = {info["name"]: owner for owner, info in infos.items()}
    for needer, names in enumerate(needs):
        for name in sorted(names):
            have = holders[(step, by_name[name])]
            if needer in have:
                if needer == rank:
                    (staging / name).symlink_to(own_dir / name)
                continue
            source = have[needer % len(have)]
            if rank == source:
                data = torch.frombuffer(bytearray((own_dir / name).read_bytes()), dtype=torch.uint8)
                dist.send(torch.tensor([data.numel()], dtype=torch.int64), needer, group=snaps.group)
                dist.send(data, needer, group=snaps.group)
            elif rank == needer:
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, source, group=snaps.group)
                data = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(data, source, group=snaps.group)
                (staging / name).write_bytes(data.numpy().tobytes())


def _corrupt(staging: Path, names: list[str], infos: dict[int, dict[str, Any]]) -> list[str]:
    """The files among `names` whose sha256 is not their info's: torn or damaged memory."""
    by_name = {info["name"]: info for info in infos.values()}
    return [
        n for n in names if hashlib.sha256((staging / n).read_bytes()).hexdigest() != by_name[n]["sha256"]
    ]


def recover(
    snaps: Snapshots,
    state: TrainState,
    durable_root: Path | None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Loaded | None, list[str], int]:
    """Load the newest complete snapshot, at or after the durable checkpoint, into `state` (every rank
    calls it). Returns what was loaded (None: nothing newer in memory; load the durable checkpoint),
    when newer snapshots were incomplete what each lost, and the newest step any rank held (0:
    none), the step a resume from the durable checkpoint wanted."""
    started = time.perf_counter()
    rank = snaps.rank
    mine = (inventory(snaps.root), newest_durable_step(durable_root) if rank == 0 else 0)
    gathered: list[Any] = [None] * snaps.world_size
    dist.all_gather_object(gathered, mine, group=control_group())
    durable = int(gathered[0][1])
    step, infos, holders, lost = choose([g[0] for g in gathered], durable)
    newest = max((int(i["step"]) for g in gathered for i in g[0]), default=0)
    if step is None:
        prune(snaps.root, keep=set())  # older than the checkpoint, or incomplete: of no use
        return None, lost, newest
    first = infos[0]
    files = [
        RankFileInfo(
            i["name"],
            i["sha256"],
            int(i["bytes"]),
            {k: (v[0], v[1], v[2], v[3]) for k, v in i["index"].items()},
        )
        for _, i in sorted(infos.items())
    ]
    manifest = build_manifest(files, first["meta"])
    if check is not None:
        check(manifest)
    # Rank 0's file holds the scheduler and the extras: one holder reads them for everyone.
    source = holders[(step, 0)][0]
    mine_needed = needed_files(state, manifest, rank) | ({rank_file_name(0)} if rank == source else set())
    needs: list[Any] = [None] * snaps.world_size
    dist.all_gather_object(needs, sorted(mine_needed), group=control_group())
    staging = snaps.root / f".recovery-rank-{rank:05d}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _fetch(snaps, step, infos, holders, needs, staging)
        # Every rank checks what it fetched; a damaged copy anywhere sends every rank to the
        # checkpoint (raising would fail each restart alike on the same memory).
        bad: list[Any] = [None] * snaps.world_size
        dist.all_gather_object(bad, _corrupt(staging, needs[rank], infos), group=control_group())
        damaged = sorted({name for names in bad for name in names})
        if damaged:
            prune(snaps.root, keep=set())
            why = f"the snapshot of step {step} has damaged files {', '.join(damaged)}"
            return None, [*lost, why], newest
        shared: list[Any] = [None]
        if rank == source:
            path = staging / rank_file_name(0)
            shared[0] = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(
                "global_state", {}
            )
        dist.broadcast_object_list(shared, src=source, group=control_group())
        reader = ShardReader(staging, manifest)
        try:
            state.load(reader.fetch, manifest["extra_state"], shared[0])
            if manifest["world_size"] == snaps.world_size:
                restore_rng_state(reader.rank_state(rank))
        finally:
            reader.close()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier(group=control_group())
    # Keep the recovered step (the only copy until this gang's first snapshot is complete).
    prune(snaps.root, keep={step})
    return Loaded(snaps.root / step_dir_name(step), manifest, time.perf_counter() - started), lost, newest
