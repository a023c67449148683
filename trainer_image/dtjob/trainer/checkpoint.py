"""Sharded, atomic, reshardable checkpoints.

Format (version `dtjob-checkpoint/1`), one directory per checkpoint under `--checkpoint-dir`:

    step-00000010/
        rank-00000.pt   torch.save of {"format", "rank", "shards": {key: 1-D tensor},
        rank-00001.pt                  "rank_state": {"torch_cpu", "torch_cuda", "numpy", "python"},
                                       "global_state": {"scheduler", "extras"} (rank 0 only)}
        ...
        manifest.json   written last, by rank 0

Each rank writes the flat shards it owns (`TrainState.state_shards`, see train_state.py and
parallel/shards.py): `shards[key]` is the slice `[offset, offset + len)` of the row-major flattened
global tensor `key`. Files are plain `torch.save` archives, readable with
`torch.load(path, weights_only=True)` and memory-mapped when loading.

`manifest.json` is one JSON object:

    format, step, world_size, generation, time (unix seconds), strategy, pipeline_stages,
    files:   {file name: {"sha256": hex, "bytes": size}}
    tensors: {key: {"shape": [...], "dtype": "float32", "shards": [[file, offset, length], ...]}}
    extra_state: the optimizer's JSON state (step counts, parameter groups' settings)
    data:        the data position (next step, seed, global batch size, the dataset's fingerprint)
    config:      the run's settings, for the record
    manifest_sha256: sha256 of the canonical JSON of every other field

A checkpoint is valid only if the manifest parses, its own checksum holds, every file's size and
sha256 match, and the shards of every tensor cover each element exactly once. Anything else (a
crash mid-write, a truncated file, a flipped byte) is skipped with a warning naming the directory,
and the next older checkpoint is tried.

Writing is atomic: ranks write into `.staging-step-<step>-g<generation>/`, exchange their files'
indexes and checksums, then rank 0 writes the manifest, fsyncs, and renames the staging directory
to `step-<step>/`; only after that rename does any rank return. Then rank 0 keeps the newest
`--keep-checkpoints` step directories that have a manifest and deletes every other one. A write
that fails on any rank (a full volume: ENOSPC) fails on every rank, and rank 0 removes its staging
directory: the newest published checkpoint stays the newest. With in-memory snapshots on, a
periodic checkpoint runs this protocol on the snapshot's thread, from the snapshot's bytes
(`Checkpointer.write`, checkpoint_background.py), while the next steps train.

Loading at any world size: rank 0 picks the newest valid checkpoint and broadcasts its manifest;
each rank then asks a `FetchRange` for the global ranges its own shards need, and the reader
copies them out of whichever files hold them (`ShardReader.fetch`), onto whatever device this run
uses (a GPU run's checkpoint loads on CPU and back). Each rank's random state is restored from its
own file when the world size is unchanged; at another world size the session derives fresh per-rank
streams from (seed, step, rank).

The checkpoint directory must be one directory shared by every worker (rank 0 checks that every
rank's file is visible before it publishes). The collectives of this protocol (indexes, the
outcome, the manifest) run on a gloo group (`group`), so they never touch the GPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from dtjob.trainer.parallel.shards import FlatShard
from dtjob.trainer.train_state import TrainState

if TYPE_CHECKING:
    from dtjob.trainer.fence import Fence

FORMAT = "dtjob-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
_HASH_CHUNK = 1 << 20

log = logging.getLogger("dtjob.trainer.checkpoint")


class CheckpointError(Exception):
    """A checkpoint could not be written, or a valid one does not fit this run."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed on some rank; every rank raises it, and nothing of the attempt
    is left on disk. `volume`: the failure was the file system's (OSError: a full, read-only or
    failing volume), so the run itself is sound and may go on without this checkpoint."""

    def __init__(self, message: str, volume: bool) -> None:
        super().__init__(message)
        self.volume = volume


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in manifest")
    return dtype


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with tmp.open("rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# --- one rank's file -------------------------------------------------------------------------


def _save_to(payload: dict[str, Any], path: Path) -> None:
    # Through a Python file: torch.save given a path reports a full volume as a RuntimeError
    # ("unexpected pos 704 vs 598"), given a file as the OSError it is (ENOSPC).
    with path.open("wb") as fh:
        torch.save(payload, fh)


@dataclass
class RankFileInfo:
    """What rank 0 needs to know about one rank's file to write the manifest."""

    name: str
    sha256: str
    bytes: int
    # key -> (offset, length, global shape, dtype name)
    index: dict[str, tuple[int, int, list[int], str]] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": [
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def write_rank_file(
    directory: Path,
    rank: int,
    shards: Mapping[str, FlatShard],
    rank_state: Mapping[str, Any],
    global_state: Mapping[str, Any] | None = None,
) -> RankFileInfo:
    """Write this rank's shards (compact CPU copies: a view would drag its whole storage along)."""
    tensors = {key: s.local.detach().reshape(-1).cpu().clone() for key, s in shards.items()}
    payload = rank_payload(rank, tensors, rank_state, global_state)
    path = directory / rank_file_name(rank)
    _write_durably(path, lambda p: _save_to(payload, p))
    return RankFileInfo(rank_file_name(rank), sha256_file(path), path.stat().st_size, rank_index(shards))


def write_rank_bytes(
    directory: Path, name: str, data: bytes | memoryview, sha256: str, index: Mapping[str, Any]
) -> RankFileInfo:
    """Write a rank file already serialized (a snapshot's bytes, checkpoint_background.py)."""
    path = directory / name
    _write_durably(path, lambda p: p.write_bytes(data))
    return RankFileInfo(name, sha256, len(data), dict(index))


def rank_payload(
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    rank_state: Mapping[str, Any],
    global_state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What one rank's file holds (torch.save'd): its flat shards (1-D CPU tensors), its random
    state, and on rank 0 the run's global state. Snapshots (snapshot.py) save the same payload."""
    payload: dict[str, Any] = {
        "format": FORMAT,
        "rank": rank,
        "shards": dict(tensors),
        "rank_state": dict(rank_state),
    }
    if global_state is not None:
        payload["global_state"] = dict(global_state)
    return payload


def rank_index(shards: Mapping[str, FlatShard]) -> dict[str, tuple[int, int, list[int], str]]:
    """key -> (offset, length, global shape, dtype name) of a rank's shards, for the manifest."""
    return {
        key: (s.offset, int(s.local.numel()), list(s.global_shape), _dtype_name(s.dtype))
        for key, s in shards.items()
    }


# --- the manifest ----------------------------------------------------------------------------


def _body_sha256(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_coverage(tensors: Mapping[str, Mapping[str, Any]]) -> None:
    """Every tensor's shards must tile [0, numel) exactly once; raise `CheckpointError` if not."""
    for key, spec in tensors.items():
        numel = 1
        for d in spec["shape"]:
            numel *= int(d)
        position = 0
        for _file, offset, length in sorted(spec["shards"], key=lambda s: (s[1], s[2])):
            if length == 0:
                continue
            if offset != position:
                what = "overlap" if offset < position else "gap"
                raise CheckpointError(f"tensor {key}: shards {what} at element {min(offset, position)}")
            position += length
        if position != numel:
            raise CheckpointError(f"tensor {key}: shards cover {position} of {numel} elements")


def build_manifest(infos: list[RankFileInfo], meta: Mapping[str, Any]) -> dict[str, Any]:
    tensors: dict[str, dict[str, Any]] = {}
    for info in infos:
        for key, (offset, length, shape, dtype) in info.index.items():
            spec = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "shards": []})
            if spec["shape"] != shape or spec["dtype"] != dtype:
                raise CheckpointError(
                    f"tensor {key}: {info.name} says {shape} {dtype}, "
                    f"another rank {spec['shape']} {spec['dtype']}"
                )
            spec["shards"].append([info.name, offset, length])
    check_coverage(tensors)
    body: dict[str, Any] = {
        **meta,
        "format": FORMAT,
        "files": {i.name: {"sha256": i.sha256, "bytes": i.bytes} for i in infos},
        "tensors": tensors,
    }
    body["manifest_sha256"] = _body_sha256(body)
    return body


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of a complete, uncorrupted checkpoint; `CheckpointError` says why not."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError("no manifest.json (the write never finished)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"manifest.json unreadable: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"manifest.json is not {FORMAT}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _body_sha256(body):
        raise CheckpointError("manifest.json checksum mismatch")
    for name, expect in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{name} is missing")
        if path.stat().st_size != expect["bytes"]:
            raise CheckpointError(f"{name} has {path.stat().st_size} bytes, manifest says {expect['bytes']}")
        if sha256_file(path) != expect["sha256"]:
            raise CheckpointError(f"{name} sha256 mismatch")
    check_coverage(manifest["tensors"])
    return manifest


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every `step-*` directory, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def find_latest_valid(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest valid checkpoint, warning about each newer one that is skipped."""
    for _step, directory in list_step_dirs(root):
        try:
            return directory, verify(directory)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", directory, err)
    return None


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` step directories that have a manifest; delete every other one.

    A directory without a manifest can never load, so it is not kept whatever its step. The
    checksums are not re-verified here (that would read every checkpoint after every save).
    """
    with_manifest = [d for _step, d in list_step_dirs(root) if (d / MANIFEST).is_file()]
    kept = set(with_manifest[:keep])
    doomed = [d for _step, d in list_step_dirs(root) if d not in kept]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def publish(staging: Path, final: Path) -> None:
    """Rename the staging directory into place, replacing an older directory of the same step."""
    trash: Path | None = None
    if final.exists():
        trash = final.with_name(f"{_TRASH_PREFIX}{final.name}-{time.time_ns()}")
        os.replace(final, trash)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Staging and trash directories of earlier, interrupted runs."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


# --- reading shards back at any world size -----------------------------------------------------


class ShardReader:
    """`FetchRange` over a checkpoint: global flat ranges, assembled from whichever files hold them."""

    def __init__(self, directory: Path, manifest: Mapping[str, Any]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._files: dict[str, dict[str, Any]] = {}

    def _file(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            self._files[name] = torch.load(
                self.directory / name, map_location="cpu", weights_only=True, mmap=True
            )
        return self._files[name]

    def keys(self) -> list[str]:
        return list(self.manifest["tensors"])

    def fetch(self, key: str, start: int, length: int) -> torch.Tensor:
        spec = self.manifest["tensors"].get(key)
        if spec is None:
            raise CheckpointError(
                f"checkpoint {self.directory} has no tensor {key!r}: it was written by a different model or "
                "optimizer; point --checkpoint-dir elsewhere or match the model flags"
            )
        numel = 1
        for d in spec["shape"]:
            numel *= int(d)
        if start < 0 or length < 0 or start + length > numel:
            raise CheckpointError(
                f"tensor {key}: range [{start}, {start + length}) outside its {numel} elements"
            )
        out = torch.empty(length, dtype=_dtype_from_name(spec["dtype"]))
        end = start + length
        for name, offset, count in spec["shards"]:
            lo, hi = max(start, offset), min(end, offset + count)
            if lo < hi:
                out[lo - start : hi - start] = self._file(name)["shards"][key][lo - offset : hi - offset]
        return out

    def rank_state(self, rank: int) -> dict[str, Any]:
        state: dict[str, Any] = self._file(rank_file_name(rank))["rank_state"]
        return state

    def global_state(self) -> dict[str, Any]:
        """What rank 0 saved for the whole run (scheduler, extras); {} in an older checkpoint."""
        state: dict[str, Any] = self._file(rank_file_name(0)).get("global_state", {})
        return state

    def close(self) -> None:
        self._files.clear()


# --- the collective protocol -------------------------------------------------------------------


@dataclass
class Loaded:
    """A checkpoint that has been loaded into the strategy."""

    directory: Path
    manifest: dict[str, Any]
    seconds: float

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


class Checkpointer:
    """Save and load checkpoints of one TrainState; every rank of the default group calls each method.

    group: a gloo group over every rank for the protocol's own messages (None: the default group).
    fence: rank 0's claim on `root` (fence.py), checked before publishing; None: not fenced.
    """

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        generation: int,
        keep: int,
        group: dist.ProcessGroup | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.keep = keep
        self.group = group
        self.fence = fence

    def save(self, step: int, state: TrainState, meta: Mapping[str, Any]) -> Path:
        """Write the checkpoint of `step`; returns its directory once it is published. A write that
        fails on any rank raises `CheckpointWriteError` on every rank, its staging directory gone."""
        shared = state.global_state() if self.rank == 0 else None
        return self.write(
            step,
            lambda staging: write_rank_file(staging, self.rank, state.state_shards(), rng_state(), shared),
            {**meta, "extra_state": state.extra_state()},
        )

    def write(
        self,
        step: int,
        write_file: Callable[[Path], RankFileInfo | str],
        meta: Mapping[str, Any],
        group: dist.ProcessGroup | None = None,
    ) -> Path:
        """The protocol of `save` around this rank's `write_file(staging)`, which writes the rank's
        file into the staging directory (or returns why it could not: told to every rank). `meta`
        holds the manifest's extra_state. `group`: the gloo group of the protocol's messages (default
        the Checkpointer's): the background checkpoints' thread (checkpoint_background.py) passes
        its own, which the training's collectives never use."""
        group = group if group is not None else self.group
        staging = self.root / f"{_STAGING_PREFIX}{step_dir_name(step)}-g{self.generation}"
        info: RankFileInfo | str
        try:
            staging.mkdir(parents=True, exist_ok=True)
            info = write_file(staging)
        except OSError as err:  # told to every rank below: none may wait for this one's file
            info = f"rank {self.rank}: {type(err).__name__}: {err}"
        infos: list[Any] = [None] * self.world_size
        # Doubles as the barrier: every rank's file is on disk (or its write failed).
        dist.all_gather_object(infos, info, group=group)
        final = self.root / step_dir_name(step)
        failed = [i for i in infos if isinstance(i, str)]
        outcome: list[Any] = [None]
        if self.rank == 0 and failed:
            outcome[0] = ("; ".join(failed), True)
        elif self.rank == 0:
            try:
                full_meta = {
                    **meta,
                    "step": step,
                    "world_size": self.world_size,
                    "generation": self.generation,
                    "time": time.time(),
                }
                for each in infos:
                    written = staging / each.name
                    if not written.is_file() or written.stat().st_size != each.bytes:
                        raise CheckpointError(
                            f"{written} is not visible from rank 0: --checkpoint-dir must be one directory "
                            "shared by every worker (e.g. a ReadWriteMany volume)"
                        )
                manifest = build_manifest(infos, full_meta)
                _write_durably(staging / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))
                _fsync_dir(staging)
                if self.fence is not None:
                    self.fence.hold()  # a gang another one replaced never publishes
                publish(staging, final)
                for gone in apply_retention(self.root, self.keep):
                    log.info("deleted old checkpoint %s (keeping the newest %d)", gone, self.keep)
            except Exception as err:
                outcome[0] = (f"rank 0: {type(err).__name__}: {err}", isinstance(err, OSError))
        if self.rank == 0 and outcome[0] is not None:
            shutil.rmtree(staging, ignore_errors=True)  # a full volume gets the attempt's space back
        dist.broadcast_object_list(outcome, src=0, group=group)
        if outcome[0] is not None:
            why, volume = outcome[0]
            raise CheckpointWriteError(f"writing checkpoint {final} failed: {why}", volume)
        return final

    def load_latest(
        self, state: TrainState, check: Callable[[dict[str, Any]], None] | None = None
    ) -> Loaded | None:
        """Load the newest valid checkpoint into `state`; None when there is none.

        `check(manifest)` runs on every rank before anything is loaded and may raise to refuse a
        checkpoint that does not fit this run (every rank sees the same manifest, so all refuse).
        """
        started = time.perf_counter()
        chosen: list[Any] = [None]
        if self.rank == 0:
            remove_leftovers(self.root)
            found = find_latest_valid(self.root)
            if found is not None:
                chosen[0] = (str(found[0]), found[1])
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        if chosen[0] is None:
            return None
        directory, manifest = Path(chosen[0][0]), chosen[0][1]
        if check is not None:
            check(manifest)
        reader = ShardReader(directory, manifest)
        try:
            state.load(reader.fetch, manifest["extra_state"], reader.global_state())
            if manifest["world_size"] == self.world_size:
                restore_rng_state(reader.rank_state(self.rank))
        finally:
            reader.close()
        dist.barrier(group=self.group)
        return Loaded(directory, manifest, time.perf_counter() - started)
