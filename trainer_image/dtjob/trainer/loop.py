"""The built-in trainer (`python -m dtjob.trainer`): one user of dtjob's public API.

It builds the model named by --model (dtjob's GPT or MLP, or the user's factory), wraps it as
--strategy says (data_parallel, fully_shard or pipeline), trains it with AdamW and a warm-up +
cosine LambdaLR in an ordinary loop, and leaves the elastic contract to `ElasticSession`: the
gang, checkpoints, resume at any world size, the global data order, SIGTERM -> exit 75, metrics.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from dtjob.trainer import build
from dtjob.trainer.config import ConfigError, TrainerConfig
from dtjob.trainer.elastic import Gang
from dtjob.trainer.flops import flops_per_token, peak_flops
from dtjob.trainer.lr_schedule import WarmupCosine
from dtjob.trainer.session import ElasticSession

log = logging.getLogger("dtjob.trainer")

# Flags a checkpoint must agree with to be loadable: they decide the tensors' names and shapes.
_MODEL_FLAGS = ("model", "layers", "dim", "heads", "seq_len")
# Flags that change the data stream: a resume with other values continues, but not the same run.
_DATA_FLAGS = ("seed", "seq_len", "global_batch_size", "data")


def _gang(c: TrainerConfig) -> Gang:
    return Gang(
        rank=c.rank,
        world_size=c.world_size,
        local_rank=c.local_rank,
        local_world_size=c.local_world_size,
        master_addr=c.master_addr,
        master_port=c.master_port,
        generation=c.generation,
        rendezvous_timeout=c.rendezvous_timeout,
        collective_timeout=c.collective_timeout,
    )


def _check_resumable(c: TrainerConfig, manifest: dict[str, Any]) -> None:
    theirs = manifest.get("config", {})
    for name in _MODEL_FLAGS:
        if name in theirs and theirs[name] != getattr(c, name):
            raise ConfigError(
                f"checkpoint step {manifest['step']} was written with --{name.replace('_', '-')}="
                f"{theirs[name]}, this run has {getattr(c, name)}; use the same model flags or another "
                "--checkpoint-dir"
            )
    if theirs.get("tensor_parallel", 1) != c.tensor_parallel:
        raise ConfigError(
            f"checkpoint step {manifest['step']} was written with --tensor-parallel "
            f"{theirs.get('tensor_parallel', 1)}, this run has {c.tensor_parallel}; resume with the same "
            "tensor-parallel size (data parallel may change), or convert it through full_state_dict"
        )
    pipelines = {"pipeline"} & {theirs.get("strategy"), c.strategy}
    if pipelines and (theirs.get("strategy"), theirs.get("pipeline_stages")) != (
        c.strategy,
        c.pipeline_stages,
    ):
        raise ConfigError(
            f"checkpoint step {manifest['step']} is from --strategy {theirs.get('strategy')} with "
            f"{theirs.get('pipeline_stages')} stages; a pipeline checkpoint loads only with the same "
            "--strategy and --pipeline-stages"
        )
    changed = [n for n in _DATA_FLAGS if n in theirs and theirs[n] != getattr(c, n)]
    if changed:
        log.warning("resuming with different %s: the data stream is not the original run's", changed)


def _check_same_data(session: ElasticSession, fingerprint: str) -> None:
    prints: list[Any] = [None] * session.world_size
    dist.all_gather_object(prints, fingerprint, group=session.group)
    if len(set(prints)) != 1:
        raise ConfigError(
            f"ranks read different data (fingerprints {sorted({str(p)[:12] for p in prints})}); every worker "
            "needs the same --data"
        )


def train(c: TrainerConfig) -> None:
    """Train until --steps (returns) or until a stop was agreed (raises session.Stopped)."""
    session = ElasticSession(
        checkpoint_dir=c.checkpoint_dir,
        checkpoint_every=c.checkpoint_every,
        keep_checkpoints=c.keep_checkpoints,
        device=c.device,
        metrics_port=c.metrics_port,
        seed=c.seed,
        log_file=c.log_file,
        gang=_gang(c),
        config=c.to_dict(),
        step_gate=c.step_gate,
    )
    try:
        _train(session, c)
    except Exception as err:
        session.failed(err)
        raise
    finally:
        session.close()


def _train(session: ElasticSession, c: TrainerConfig) -> None:
    dataset, fingerprint, shuffle = build.build_dataset(c)
    _check_same_data(session, fingerprint)
    model = build.build_model(c).to(session.device)
    dims = {n: p.dim() for n, p in model.named_parameters()}
    n_params = sum(p.numel() for p in model.parameters())
    # The attention term needs the transformer's shape: dtjob's GPT only (#41).
    shape = (c.layers, c.seq_len, c.dim) if c.model == "gpt" else ()
    model_flops = flops_per_token(n_params, *shape)
    parallel = build.parallelize(model, c)
    wrapped = parallel.model
    if session.rank == 0:
        log.info(
            "parallelism: tensor parallel %d x pipeline %d x data parallel %d (world %d, --strategy %s)",
            c.tensor_parallel,
            c.stages,
            c.data_parallel_size,
            session.world_size,
            c.strategy,
        )
    optimizer = build.optimizer(wrapped, dims, c)
    schedule = WarmupCosine(c.lr, c.min_lr, c.warmup_steps, c.steps)
    # LambdaLR's k counts optimizer steps from 0: step s (1-based) runs at lr_at(s).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: schedule.lr_at(k + 1) / c.lr)
    session.track(wrapped, optimizer, scheduler)
    sampler = session.batch_sampler(dataset, c.global_batch_size, shuffle=shuffle)
    session.resume(check=lambda manifest: _check_resumable(c, manifest))
    scaler = _grad_scaler(c, session)
    peak = peak_flops(session.device, c.precision, c.peak_tflops)
    is_pipeline = c.strategy == "pipeline"
    for step in session.steps(c.steps):
        lr = optimizer.param_groups[0]["lr"]
        x, y = build.inputs_and_targets([dataset[i] for i in sampler.indices(step)])
        x, y = session.to_device(x), session.to_device(y)
        if is_pipeline:
            loss: torch.Tensor | float = wrapped.step(x, y, scaler=scaler)  # type: ignore[operator]
        else:
            loss = _forward_backward(wrapped, parallel.loss, x, y, c.grad_accum, scaler)
        if c.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), c.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = session.step_seconds
        tokens_per_s = c.global_batch_size * c.seq_len / seconds
        fields: dict[str, Any] = {"lr": lr, "tokens_per_s": round(tokens_per_s, 1)}
        if c.tensor_parallel > 1:
            fields.update(tensor_parallel=c.tensor_parallel, data_parallel=c.data_parallel_size)
        if peak:
            fields["mfu"] = round(model_flops * tokens_per_s / (peak * session.world_size), 4)
        value = session.report(loss, **fields)
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {step}; lower --lr or check the data")
        if session.rank == 0:
            log.info(
                "step %d/%d  loss %.4f  lr %.2e  %.0f tokens/s  world %d  dp %d  gen %d",
                step,
                c.steps,
                value,
                lr,
                tokens_per_s,
                session.world_size,
                c.data_parallel_size,
                session.generation,
            )


def _grad_scaler(c: TrainerConfig, session: ElasticSession) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling (a no-op otherwise). Sharded gradients (ZeRO, pipeline stages)
    need every rank to agree whether any of them overflowed: torch's ShardedGradScaler all-reduces
    that finding over the world, so all ranks skip the same steps. The pipeline scales its loss
    itself, on its last stage (Pipeline.step's scaler)."""
    enabled = c.precision == "fp16"
    if c.strategy == "ddp" or not enabled:
        return torch.amp.GradScaler(session.device.type, enabled=enabled)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(session.device.type, enabled=enabled)


def _forward_backward(
    model: Any,
    loss_fn: build.LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: int,
    scaler: torch.amp.GradScaler,
) -> torch.Tensor:
    """This rank's mean loss over `parts` micro-steps; gradients reduced after the last only."""
    total = torch.zeros((), device=x.device)
    chunks = list(zip(x.chunk(parts), y.chunk(parts), strict=True))
    for i, (xi, yi) in enumerate(chunks):
        accumulate = i < len(chunks) - 1
        with model.no_sync() if accumulate else contextlib.nullcontext():
            loss = loss_fn(model(xi), yi) / parts
            scaler.scale(loss).backward()
        total += loss.detach()
    return total
