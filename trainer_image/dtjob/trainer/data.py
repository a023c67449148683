"""Byte-level language-modelling data with a global, world-size-independent order.

The corpus is the bytes of a set of text files concatenated in sorted path order (each followed by
a newline). The built-in corpus is the Python standard library's own `.py` sources, found with
`sysconfig` at run time, so every machine with Python has real text to train on (tests and
vendored packages excluded). `--data PATH` takes one file or a directory, read recursively;
files whose first 8 KiB contain a NUL byte are taken for binary and skipped.

A sample is `seq_len + 1` consecutive bytes; the input is the first `seq_len`, the target the last
`seq_len` (the next byte at every position); the vocabulary is the 256 byte values.

Order: `GlobalBatchSampler` defines which samples every global step reads, for any map-style
dataset (this corpus as `TokenWindows`, whose item i is the window starting at byte i, or a user's
dataset): a function of (seed, step) only, so step s sees the same samples whatever the world size.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

VOCAB_SIZE = 256
# Directories of the standard library that are not representative source (huge generated test
# data, a GUI, vendored third-party packages).
_STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
_BINARY_PROBE_BYTES = 8192


class DataError(Exception):
    """The corpus cannot be read or is too small for the requested sample length."""


def builtin_corpus_files() -> list[Path]:
    """The standard library's `.py` files, in sorted relative-path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        files.extend(Path(dirpath, name) for name in sorted(filenames) if name.endswith(".py"))
    return files


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"--data {path}: no such file or directory")
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            candidate = Path(dirpath, name)
            with candidate.open("rb") as fh:
                if b"\0" not in fh.read(_BINARY_PROBE_BYTES):
                    files.append(candidate)
    return files


@dataclass(frozen=True)
class Corpus:
    """The concatenated bytes and a fingerprint naming exactly this content."""

    tokens: np.ndarray  # uint8, 1-D
    fingerprint: str  # sha256 hex of the bytes
    source: str  # where it came from, for logs
    files: int

    @classmethod
    def load(cls, data: str | None) -> Corpus:
        source = data if data else "python-stdlib:" + sysconfig.get_paths()["stdlib"]
        paths = _text_files(Path(data)) if data else builtin_corpus_files()
        chunks: list[bytes] = []
        for p in paths:
            chunks.append(p.read_bytes())
            chunks.append(b"\n")
        blob = b"".join(chunks)
        if not blob:
            raise DataError(f"--data {source}: no text files found")
        return cls(
            tokens=np.frombuffer(blob, dtype=np.uint8),
            fingerprint=hashlib.sha256(blob).hexdigest(),
            source=source,
            files=len(paths),
        )


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The corpus as a map-style dataset: item i is (bytes [i, i + seq_len), the same shifted by one)."""

    def __init__(self, corpus: Corpus, seq_len: int) -> None:
        if len(corpus.tokens) < seq_len + 2:
            raise DataError(
                f"corpus {corpus.source} has {len(corpus.tokens)} bytes, "
                f"fewer than --seq-len + 2 = {seq_len + 2}"
            )
        self.corpus = corpus
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.corpus.tokens) - self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.corpus.tokens[i : i + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class GlobalBatchSampler(Sampler[list[int]]):
    """The samples of every global step of a map-style dataset, and this rank's part of them.

    Global step s (1-based) takes `global_batch_size` indices that depend on (seed, s) alone, so
    step s reads the same samples whatever the world size, and a run resumed at step s needs no
    position beyond s itself. Data-parallel rank r of R takes rows [r * B/R, (r + 1) * B/R).

    shuffle="epoch": the index stream is one permutation of the dataset per epoch (seeded by
        (seed, epoch)) laid end to end; step s takes items [(s-1) * B, s * B) of it.
    shuffle="replacement": step s draws B indices uniformly (seeded by (seed, s)): for datasets
        too large to permute, such as every offset of a text corpus.

    As a torch `Sampler` (DataLoader(dataset, batch_sampler=sampler)) it yields this rank's
    indices for steps start_step + 1 .. steps.
    """

    def __init__(
        self,
        size: int,
        global_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: str = "epoch",
        steps: int | None = None,
    ) -> None:
        if size < 1:
            raise DataError("the dataset is empty")
        if shuffle not in ("epoch", "replacement"):
            raise ValueError(f"GlobalBatchSampler: shuffle must be 'epoch' or 'replacement', got {shuffle!r}")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the {dp_size} data-parallel "
                f"replicas; use a multiple of {dp_size}"
            )
        self.size = size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.steps = steps
        self.start_step = 0
        self._epoch: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._epoch = (epoch, rng.permutation(self.size))
        return self._epoch[1]

    def global_indices(self, step: int) -> np.ndarray:
        """The dataset indices of global step `step` (1-based), in row order."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        B = self.global_batch_size
        if self.shuffle == "replacement":
            rng = np.random.Generator(np.random.PCG64([self.seed, step]))
            return rng.integers(0, self.size, size=B, dtype=np.int64)
        first = (step - 1) * B
        out = np.empty(B, dtype=np.int64)
        filled = 0
        while filled < B:
            epoch, at = divmod(first + filled, self.size)
            take = min(B - filled, self.size - at)
            out[filled : filled + take] = self._permutation(epoch)[at : at + take]
            filled += take
        return out

    def indices(self, step: int) -> list[int]:
        """This data-parallel rank's indices of global step `step`."""
        per_rank = self.global_batch_size // self.dp_size
        rows = self.global_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [int(i) for i in rows]

    def __iter__(self) -> Iterator[list[int]]:
        if self.steps is None:
            raise ValueError("GlobalBatchSampler: give steps= to iterate it as a batch sampler")
        for step in range(self.start_step + 1, self.steps + 1):
            yield self.indices(step)

    def __len__(self) -> int:
        return 0 if self.steps is None else max(0, self.steps - self.start_step)

    def position(self, next_step: int) -> dict[str, object]:
        """What a checkpoint records so a resumed run can check it continues the same stream."""
        return {
            "next_step": next_step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "dataset_size": self.size,
            "shuffle": self.shuffle,
        }
