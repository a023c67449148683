"""The training loop: load the newest checkpoint, train step by step, checkpoint, stop on request.

Per step s (1-based): set the learning rate of s, read this rank's slice of global batch s, run
one optimizer step, agree with the other ranks on whether to stop, report, and checkpoint when
s is a multiple of --checkpoint-every, the last step, or the step a stop was agreed after.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist

from dtjob import contract
from dtjob.trainer import build, elastic
from dtjob.trainer.checkpoint import Checkpointer, Loaded
from dtjob.trainer.comm_metrics import instrument_comm
from dtjob.trainer.config import ConfigError, TrainerConfig
from dtjob.trainer.data import Corpus, DataError, GlobalBatches
from dtjob.trainer.metrics import TrainerMetrics
from dtjob.trainer.parallel import TrainStrategy, parallelize
from dtjob.trainer.schedule import WarmupCosine
from dtjob.trainer.signals import EXIT_STOPPED, StopRequest

log = logging.getLogger("dtjob.trainer")

EXIT_OK = contract.EXIT_OK

# Flags a checkpoint must agree with to be loadable: they decide the tensors' names and shapes.
_MODEL_FLAGS = ("model", "layers", "dim", "heads", "seq_len")
# Flags that change the data stream: a resume with other values continues, but not the same run.
_DATA_FLAGS = ("seed", "seq_len", "global_batch_size")


class Trainer:
    def __init__(self, c: TrainerConfig, stop: StopRequest, metrics: TrainerMetrics) -> None:
        self.c = c
        self.stop = stop
        self.metrics = metrics
        self.corpus = self._load_corpus()
        self.batches = GlobalBatches(self.corpus, c.seq_len, c.global_batch_size, c.seed)
        self.schedule = WarmupCosine(c.lr, c.min_lr, c.warmup_steps, c.steps)
        self.checkpointer = (
            Checkpointer(Path(c.checkpoint_dir), c.rank, c.world_size, c.generation, c.keep_checkpoints)
            if c.checkpoint_dir
            else None
        )
        self.strategy: TrainStrategy | None = None
        self.last_saved_step = -1
        self.last_saved_time = 0.0  # unix seconds of the checkpoint at last_saved_step

    def _load_corpus(self) -> Corpus:
        try:
            corpus = Corpus.load(self.c.data)
            GlobalBatches(corpus, self.c.seq_len, self.c.global_batch_size, self.c.seed)
        except (DataError, OSError) as err:
            raise ConfigError(f"{err} (--data, env DTJOB_DATA)") from None
        log.info("corpus %s: %d files, %d bytes", corpus.source, corpus.files, len(corpus.tokens))
        return corpus

    # -- start ----------------------------------------------------------------------------------
    def _check_same_corpus(self) -> None:
        prints: list[Any] = [None] * self.c.world_size
        dist.all_gather_object(prints, self.corpus.fingerprint)
        if len(set(prints)) != 1:
            raise RuntimeError(
                f"ranks read different corpora (sha256 prefixes {sorted({p[:12] for p in prints})}); "
                "every worker needs the same --data"
            )

    def _check_resumable(self, manifest: dict[str, Any]) -> None:
        theirs = manifest.get("config", {})
        for name in _MODEL_FLAGS:
            if name in theirs and theirs[name] != getattr(self.c, name):
                raise ConfigError(
                    f"checkpoint step {manifest['step']} was written with --{name.replace('_', '-')}="
                    f"{theirs[name]}, this run has {getattr(self.c, name)}; use the same model flags "
                    "or another --checkpoint-dir"
                )
        pipelines = {"pipeline"} & {theirs.get("strategy"), self.c.strategy}
        if pipelines and (theirs.get("strategy"), theirs.get("pipeline_stages")) != (
            self.c.strategy,
            self.c.pipeline_stages,
        ):
            raise ConfigError(
                f"checkpoint step {manifest['step']} is from --strategy {theirs.get('strategy')} with "
                f"{theirs.get('pipeline_stages')} stages; a pipeline checkpoint loads only with the same "
                "--strategy and --pipeline-stages"
            )
        changed = [n for n in _DATA_FLAGS if n in theirs and theirs[n] != getattr(self.c, n)]
        if manifest["data"]["corpus_fingerprint"] != self.corpus.fingerprint:
            changed.append("data (corpus content)")
        if changed:
            log.warning("resuming with different %s: the data stream is not the original run's", changed)

    def _resume(self, strategy: TrainStrategy) -> int:
        if self.checkpointer is None:
            return 0
        loaded: Loaded | None = self.checkpointer.load_latest(strategy, self._check_resumable)
        if loaded is None:
            log.info("no checkpoint in %s; starting at step 1", self.checkpointer.root)
            return 0
        step = loaded.step
        if loaded.manifest["world_size"] != self.c.world_size:
            # Per-rank random streams cannot be carried across world sizes; derive fresh ones.
            seed = int(np.random.SeedSequence([self.c.seed, step, self.c.rank]).generate_state(1)[0])
            torch.manual_seed(seed)
            random.seed(seed)
        self.last_saved_step = step
        self.last_saved_time = float(loaded.manifest["time"])
        self.metrics.checkpoint_load_seconds.set(loaded.seconds)
        self.metrics.last_checkpoint_step.set(step)
        self.metrics.last_checkpoint_timestamp.set(loaded.manifest["time"])
        self.metrics.step.set(step)
        log.info(
            "resumed from %s (written at world size %d, generation %d) in %.2fs",
            loaded.directory,
            loaded.manifest["world_size"],
            loaded.manifest["generation"],
            loaded.seconds,
        )
        return step

    # -- steps ----------------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        if self.checkpointer is None or self.strategy is None or step == self.last_saved_step:
            return
        started = time.perf_counter()
        meta = {
            "strategy": self.c.strategy,
            "pipeline_stages": self.c.pipeline_stages if self.c.strategy == "pipeline" else 1,
            "schedule": self.schedule.to_dict(),
            "data": self.batches.position(step + 1),
            "config": self.c.to_dict(),
        }
        path = self.checkpointer.save(step, self.strategy, meta)
        seconds = time.perf_counter() - started
        self.last_saved_step = step
        self.last_saved_time = time.time()
        self.metrics.checkpoint_save_seconds.set(seconds)
        self.metrics.last_checkpoint_step.set(step)
        self.metrics.last_checkpoint_timestamp.set(self.last_saved_time)
        self.metrics.checkpoints_saved.inc()
        log.info("checkpoint %s written in %.2fs", path, seconds)

    def _report(self, out: TextIO, step: int, loss: float, lr: float, seconds: float) -> None:
        samples_per_s = self.c.global_batch_size / seconds
        tokens_per_s = samples_per_s * self.c.seq_len
        m = self.metrics
        m.step.set(step)
        m.loss.set(loss)
        m.learning_rate.set(lr)
        m.samples_per_second.set(samples_per_s)
        m.tokens_per_second.set(tokens_per_s)
        if self.c.rank != 0:
            return
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "world_size": self.c.world_size,
            "generation": self.c.generation,
            "samples_per_s": round(samples_per_s, 3),
            "tokens_per_s": round(tokens_per_s, 1),
            "step_seconds": round(seconds, 6),
        }
        out.write(json.dumps(record) + "\n")
        out.flush()
        print(
            f"step {step}/{self.c.steps}  loss {loss:.4f}  lr {lr:.2e}  {samples_per_s:.1f} samples/s  "
            f"world {self.c.world_size}  gen {self.c.generation}",
            file=sys.stderr,
            flush=True,
        )

    def run(self, out: TextIO) -> int:
        c = self.c
        elastic.init_process_group(c)
        # Until the gang exists a SIGTERM kills at once (there is nothing to save, and the wait for
        # peers is a C++ call a Python handler could not interrupt); from here on it means "finish
        # the step, checkpoint, exit 75".
        self.stop.install()
        self._check_same_corpus()
        instrument_comm(self.metrics)
        strategy = parallelize(build.build_model(c), build.parallel_config(c), build.optimizer_factory(c))
        self.strategy = strategy
        start = self._resume(strategy)
        if start >= c.steps:
            log.info("checkpoint step %d is already at --steps %d; nothing to do", start, c.steps)
            self._log_complete()
            return EXIT_OK
        if elastic.agree(self.stop.requested):
            log.info("stop requested before the first step; the newest checkpoint stays at step %d", start)
            return EXIT_STOPPED
        for step in range(start + 1, c.steps + 1):
            lr = self.schedule.lr_at(step)
            strategy.set_lr(lr)
            inputs, targets = self.batches.batch(
                step, strategy.data_parallel_rank, strategy.data_parallel_size
            )
            started = time.perf_counter()
            loss = strategy.train_step(inputs, targets)
            stopping = elastic.agree(self.stop.requested)
            seconds = time.perf_counter() - started
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr or check the data")
            self._report(out, step, loss, lr, seconds)
            if stopping or step == c.steps or (c.checkpoint_every > 0 and step % c.checkpoint_every == 0):
                self._save(step)
            if stopping:
                if self.checkpointer is None:
                    log.warning("stopping at step %d without a checkpoint: no --checkpoint-dir", step)
                log.info("stopped after step %d on %s; exit %d", step, self.stop.signal_name, EXIT_STOPPED)
                return EXIT_STOPPED
        self._log_complete()
        return EXIT_OK

    def _log_complete(self) -> None:
        """The operator reads this line from rank 0's log once it exited (its metrics endpoint is
        gone by then): the final step and the last checkpoint (operator/dtjob/operator/kube.py).
        Also written by a generation that found the work already done (a gang restarted just as
        its predecessor finished), so the job's final step is never a stale scrape."""
        if self.last_saved_step > 0:
            log.info(contract.complete_line(self.c.steps, self.last_saved_step, self.last_saved_time))
        else:
            log.info(contract.complete_line(self.c.steps))


def open_output(c: TrainerConfig) -> AbstractContextManager[TextIO]:
    """Where rank 0's JSON lines go: --log-file (appended) or stdout."""
    if c.log_file and c.rank == 0:
        Path(c.log_file).parent.mkdir(parents=True, exist_ok=True)
        return open(c.log_file, "a", encoding="utf-8")
    return nullcontext(sys.stdout)
