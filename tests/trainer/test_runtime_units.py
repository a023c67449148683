"""In-process tests of the trainer runtime's pure parts: flags, data order, LR schedule, and the
checkpoint format's write / verify / reshard-read functions (no process group needed)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from dtjob.trainer import checkpoint as ckpt
from dtjob.trainer import elastic
from dtjob.trainer.config import ConfigError, TrainerConfig, parse
from dtjob.trainer.data import Corpus, GlobalBatchSampler, TokenWindows
from dtjob.trainer.lr_schedule import WarmupCosine
from dtjob.trainer.parallel.comm import COLLECTIVES
from dtjob.trainer.parallel.shards import FlatShard
from tests.trainer.runtime_gang import free_port

# --- flags and environment -----------------------------------------------------------------------


def test_flag_choices_are_what_the_wrappers_accept() -> None:
    """The trainer's flags are declared without importing torch; the wrappers validate them."""
    from dtjob.trainer.device import DEVICES
    from dtjob.trainer.parallel.common import PRECISIONS

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(TrainerConfig)}
    assert set(choices["collective"]) == set(COLLECTIVES)
    assert set(choices["precision"]) == set(PRECISIONS)
    assert set(choices["device"]) == set(DEVICES)


def test_flag_beats_environment_beats_default() -> None:
    env = {"DTJOB_STEPS": "7", "DTJOB_LR": "0.5", "WORLD_SIZE": "4", "RANK": "3", "DTJOB_GENERATION": "2"}
    c = parse(["--steps", "9", "--global-batch-size", "8"], env)
    assert (c.steps, c.lr, c.world_size, c.rank, c.generation) == (9, 0.5, 4, 3, 2)
    assert parse([], {}).strategy == "ddp"


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--strategy", "zero"], {}, "--strategy"),
        ([], {"DTJOB_STRATEGY": "zero"}, "DTJOB_STRATEGY"),
        (["--steps", "ten"], {}, "--steps"),
        (["--global-batch-size", "10"], {"WORLD_SIZE": "4"}, "--global-batch-size"),
        (["--strategy", "pipeline", "--pipeline-stages", "2"], {"WORLD_SIZE": "3"}, "--pipeline-stages"),
        (["--dim", "30", "--heads", "4"], {}, "--heads"),
        (["--no-such-flag"], {}, "--no-such-flag"),
        (["--rank", "4", "--world-size", "4"], {}, "--rank"),
        (["--model", "my_models.make"], {}, "--model"),
        (["--data", "no/such/dir"], {}, "--data"),
        (["--grad-accum", "3", "--global-batch-size", "8"], {"WORLD_SIZE": "2"}, "--grad-accum"),
        (["--grad-compression", "bf16", "--strategy", "fsdp"], {}, "--grad-compression"),
        (["--activation-checkpointing", "maybe"], {}, "--activation-checkpointing"),
        (["--device", "tpu"], {}, "--device"),
    ],
)
def test_bad_configuration_names_the_flag(argv: list[str], env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        parse(argv, env)


# --- data ------------------------------------------------------------------------------------------


def _corpus(tmp_path: Path) -> Corpus:
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("def f(x):\n    return x * 2\n" * 40)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    return Corpus.load(str(tmp_path))


def test_corpus_reads_text_files_in_sorted_order_and_skips_binary(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    assert corpus.files == 2
    assert bytes(corpus.tokens[:9]) == b"the quick"
    assert 0 not in set(corpus.tokens.tolist())


def test_flags_parse_booleans_and_user_code() -> None:
    c = parse(["--activation-checkpointing", "true", "--zero3-prefetch", "0", "--model", "pkg.mod:make"], {})
    assert c.activation_checkpointing is True and c.zero3_prefetch is False and c.model == "pkg.mod:make"
    assert parse([], {"DTJOB_DATA": "pkg.data:load"}).data == "pkg.data:load"


@pytest.mark.parametrize("shuffle", ["epoch", "replacement"])
def test_global_step_samples_do_not_depend_on_world_size(shuffle: str) -> None:
    whole = GlobalBatchSampler(50, 12, seed=3, shuffle=shuffle)
    for step in (1, 5, 9):
        for dp_size in (2, 3, 4):
            parts = [
                GlobalBatchSampler(50, 12, dp_rank=r, dp_size=dp_size, seed=3, shuffle=shuffle)
                for r in range(dp_size)
            ]
            assert [i for p in parts for i in p.indices(step)] == whole.indices(step)
    assert whole.indices(5) != whole.indices(6)
    assert GlobalBatchSampler(50, 12, seed=4, shuffle=shuffle).indices(5) != whole.indices(5)


def test_epoch_order_visits_every_sample_once_per_epoch() -> None:
    sampler = GlobalBatchSampler(30, 12, seed=1, steps=5)  # 60 samples: two epochs of 30
    seen = [i for batch in sampler for i in batch]
    assert sorted(seen[:30]) == list(range(30)) and sorted(seen[30:60]) == list(range(30))
    sampler.start_step = 3
    assert list(sampler) == [sampler.indices(4), sampler.indices(5)]


def test_corpus_windows_are_inputs_and_next_bytes(tmp_path: Path) -> None:
    windows = TokenWindows(_corpus(tmp_path), seq_len=16)
    x, y = windows[7]
    assert x.shape == y.shape == (16,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]) and bytes(x[:3].tolist()) == bytes(windows.corpus.tokens[7:10])
    assert len(windows) == len(windows.corpus.tokens) - 16


def test_sampler_rejects_a_batch_the_replicas_cannot_split() -> None:
    with pytest.raises(ValueError, match="not divisible by the 5 data-parallel replicas"):
        GlobalBatchSampler(100, 12, dp_size=5)


def test_builtin_corpus_is_the_standard_library() -> None:
    corpus = Corpus.load(None)
    assert corpus.files > 100 and len(corpus.tokens) > 1_000_000
    assert corpus.source.startswith("python-stdlib:")


# --- learning-rate schedule --------------------------------------------------------------------------


def test_warmup_then_cosine_to_the_floor() -> None:
    s = WarmupCosine(peak_lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [s.lr_at(i) for i in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s.lr_at(9) == pytest.approx(0.55)  # half-way through the decay
    assert s.lr_at(14) == pytest.approx(0.1)
    assert all(s.lr_at(i) >= s.lr_at(i + 1) for i in range(4, 14))


# --- checkpoint format ---------------------------------------------------------------------------------


def _shards_of(tensors: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, FlatShard]:
    """Uneven contiguous split, like a strategy's: rank r gets [r*n//size, (r+1)*n//size)."""
    out = {}
    for key, t in tensors.items():
        n = t.numel()
        lo, hi = rank * n // size, (rank + 1) * n // size
        out[key] = FlatShard(tuple(t.shape), t.dtype, lo, t.reshape(-1)[lo:hi])
    return out


def _write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], size: int) -> dict[str, object]:
    directory.mkdir(parents=True)
    infos = [
        ckpt.write_rank_file(directory, r, _shards_of(tensors, r, size), ckpt.rng_state())
        for r in range(size)
    ]
    manifest = ckpt.build_manifest(infos, {"step": 1, "world_size": size})
    (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return manifest


TENSORS = {
    "model.w": torch.arange(35, dtype=torch.float32).reshape(5, 7),
    "optim.w.exp_avg": torch.linspace(-1, 1, 35).reshape(5, 7),
    "model.ids": torch.arange(6, dtype=torch.int64),
}


def test_written_at_four_ranks_read_back_at_three(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "c", TENSORS, size=4)
    manifest = ckpt.verify(tmp_path / "c")
    reader = ckpt.ShardReader(tmp_path / "c", manifest)
    for key, t in TENSORS.items():
        flat = t.reshape(-1)
        for r in range(3):  # the new world size's ranges straddle the old files' boundaries
            lo, hi = r * flat.numel() // 3, (r + 1) * flat.numel() // 3
            got = reader.fetch(key, lo, hi - lo)
            assert got.dtype == t.dtype and torch.equal(got, flat[lo:hi])
    with pytest.raises(ckpt.CheckpointError, match="no tensor"):
        reader.fetch("model.missing", 0, 1)
    assert torch.equal(reader.rank_state(2)["torch_cpu"], torch.get_rng_state())


def test_shards_must_tile_every_tensor_exactly_once(tmp_path: Path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    shards = _shards_of(TENSORS, 0, 2)
    infos = [ckpt.write_rank_file(d, 0, shards, {}), ckpt.write_rank_file(d, 1, shards, {})]
    with pytest.raises(ckpt.CheckpointError, match=r"overlap|cover"):
        ckpt.build_manifest(infos, {})


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest", "manifest-edit", "missing-file"])
def test_damaged_checkpoint_fails_verification(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "c"
    _write_checkpoint(d, TENSORS, size=2)
    rank_file = d / ckpt.rank_file_name(1)
    if damage == "flip":
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rank_file.write_bytes(bytes(data))
    elif damage == "truncate":
        rank_file.write_bytes(rank_file.read_bytes()[:-10])
    elif damage == "no-manifest":
        (d / ckpt.MANIFEST).unlink()
    elif damage == "manifest-edit":
        text = (d / ckpt.MANIFEST).read_text().replace('"step": 1', '"step": 2')
        (d / ckpt.MANIFEST).write_text(text)
    else:
        rank_file.unlink()
    with pytest.raises(ckpt.CheckpointError):
        ckpt.verify(d)


def test_latest_valid_skips_newer_broken_ones_and_retention_keeps_k(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _write_checkpoint(tmp_path / ckpt.step_dir_name(step), TENSORS, size=2)
    (tmp_path / ckpt.step_dir_name(8) / ckpt.rank_file_name(0)).write_bytes(b"garbage")
    found = ckpt.find_latest_valid(tmp_path)
    assert found is not None and found[0].name == "step-00000006"
    (tmp_path / ckpt.step_dir_name(10)).mkdir()  # no manifest: never kept
    deleted = ckpt.apply_retention(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-00000002", "step-00000004", "step-00000010"]
    assert [s for s, _ in ckpt.list_step_dirs(tmp_path)] == [8, 6]


def test_a_worker_waiting_for_its_master_says_where_it_looks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # a port nothing listens on
    monkeypatch.setattr(elastic, "_WAIT_REPORT_SECONDS", 0.2)
    with caplog.at_level(logging.WARNING, logger="dtjob.trainer"):
        elastic._wait_for_port("localhost", port, time.monotonic() + 1.0)
    said = [r.getMessage() for r in caplog.records]
    assert said and all(f"master's store at localhost:{port} (127.0.0.1)" in m for m in said), said
    assert len(said) <= 5, "once per report interval, not per attempt"
