"""The trainer's configuration: every flag, its environment variable, and the checks between them.

`TrainerConfig` is the single description of a run. Each field below is one command-line flag
(`--global-batch-size` for `global_batch_size`) that can also be set from an environment variable
(`DTJOB_GLOBAL_BATCH_SIZE`); a flag wins over its variable, the variable over the default. The
process-group fields (`rank`, `world_size`, `master_addr`, `master_port`, `local_rank`) read the
torchrun-compatible variables `RANK`, `WORLD_SIZE`, ... that the operator sets on every worker pod;
these, and every other variable of the pod environment, are read by `dtjob.contract.PodEnv`.

This module does not import torch, so a bad flag is reported in a fraction of a second. Every
problem is a `ConfigError` whose message names the flag (and its environment variable) and what
to do; the entry point prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from dtjob import contract

EXIT_CONFIG_ERROR = contract.EXIT_CONFIG_ERROR


class ConfigError(Exception):
    """A flag or environment variable is missing, malformed, or inconsistent with another."""


def _opt(
    default: Any,
    help: str,
    *,
    env: str | None = None,
    choices: Sequence[str] | None = None,
    flag: bool = True,
) -> Any:
    """A dataclass field carrying its flag's help, env variable name and allowed values."""
    return field(default=default, metadata={"help": help, "env": env, "choices": choices, "flag": flag})


@dataclass
class TrainerConfig:
    """Everything one trainer process needs to know; see each field's help for its meaning."""

    # --- parallelism -------------------------------------------------------------------------
    strategy: str = _opt("ddp", "parallel strategy", choices=("ddp", "fsdp", "pipeline"))
    zero_stage: int = _opt(3, "ZeRO stage for --strategy fsdp: 1 optimizer state, 2 +gradients, 3 +params")
    units: str | None = _opt(
        None, "--strategy fsdp: comma-separated module names of the units (default: auto)"
    )
    zero3_prefetch: bool = _opt(True, "--strategy fsdp, ZeRO-3: gather the next unit while one computes")
    tensor_parallel: int = _opt(
        1,
        "tensor-parallel size T: each layer split over T processes of one pod (a divisor of "
        "LOCAL_WORLD_SIZE), composed with --strategy over the data-parallel replicas; --model gpt or "
        "a model tensor_parallel's plan='auto' knows (spec.parallelism.tensor)",
    )
    pipeline_stages: int = _opt(
        2,
        "pipeline stages for --strategy pipeline; WORLD_SIZE must be a multiple (spec.parallelism.pipeline)",
    )
    microbatches: int = _opt(4, "micro-batches per step for --strategy pipeline")
    schedule: str = _opt("1f1b", "pipeline schedule", choices=("gpipe", "1f1b"))
    split: str | None = _opt(None, "--strategy pipeline: comma-separated module names where stages 1.. begin")
    bucket_mb: float = _opt(25.0, "--strategy ddp: gradient bucket size in MiB")
    first_bucket_mb: float = _opt(1.0, "--strategy ddp: size of the first gradient bucket in MiB")
    grad_compression: str = _opt(
        "none", "--strategy ddp: gradients on the wire in this dtype", choices=("none", "bf16", "fp16")
    )
    grad_accum: int = _opt(1, "micro-steps per optimizer step (ddp, fsdp): the rank's batch cut in parts")
    activation_checkpointing: bool = _opt(False, "recompute each block's activations in backward")
    collective: str = _opt(
        "auto",
        "collective algorithm (native = torch's own: gloo, or NCCL on CUDA)",
        choices=("auto", "ring", "hd", "direct", "hier", "native"),  # = parallel.comm.COLLECTIVES (tested)
    )
    device: str = _opt(
        "auto", "where to compute: CUDA if available (auto), cpu, cuda", choices=("auto", "cpu", "cuda")
    )
    precision: str = _opt(
        "fp32",
        "compute precision: bf16/fp16 autocast with fp32 master weights (fp16 with loss scaling)",
        choices=("fp32", "bf16", "fp16"),
    )
    peak_tflops: float = _opt(0.0, "device peak TFLOP/s for the MFU metric (0: from a table of known GPUs)")
    # --- model -------------------------------------------------------------------------------
    model: str = _opt("gpt", "gpt, mlp, or pkg.module:factory (a callable returning an nn.Module)")
    layers: int = _opt(2, "transformer blocks (gpt) or hidden layers (mlp)")
    dim: int = _opt(64, "model width")
    heads: int = _opt(4, "attention heads (gpt); must divide --dim")
    seq_len: int = _opt(64, "tokens (bytes) per sample")
    # --- data and optimisation ---------------------------------------------------------------
    data: str | None = _opt(
        None,
        "file or directory of text files, or pkg.module:factory (a callable returning a map-style "
        "dataset) (default: Python's standard library)",
    )
    steps: int = _opt(200, "total optimizer steps of the run (resumed runs count from the checkpoint)")
    global_batch_size: int = _opt(16, "samples per step over all ranks; split evenly between replicas")
    lr: float = _opt(3e-3, "peak learning rate (AdamW)")
    warmup_steps: int = _opt(10, "steps of linear warm-up from 0 to --lr")
    min_lr: float = _opt(3e-4, "learning rate at the end of the cosine decay")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    grad_clip: float = _opt(0.0, "clip the global gradient norm to this value (0: off)")
    seed: int = _opt(0, "seed of model init and data order")
    # --- checkpoints -------------------------------------------------------------------------
    checkpoint_dir: str | None = _opt(None, "directory of checkpoints (default: no checkpoints)")
    checkpoint_every: int = _opt(50, "write a checkpoint every N steps (0: only at the end and on SIGTERM)")
    keep_checkpoints: int = _opt(3, "how many of the newest checkpoints to keep")
    # --- observability and timeouts ----------------------------------------------------------
    metrics_port: int = _opt(0, "Prometheus port; each process serves on port + LOCAL_RANK (0: off)")
    log_file: str | None = _opt(None, "append the per-step JSON lines here instead of stdout")
    collective_timeout: float = _opt(60.0, "seconds a collective may wait for a peer before failing")
    rendezvous_timeout: float = _opt(300.0, "seconds to wait for the master and the whole gang at start")
    step_gate: str | None = _opt(
        None,
        "tests: before step s, wait until this file holds a number >= s (lets a test act at a chosen step)",
    )
    # --- the gang (torchrun-compatible environment, set by the operator) ------------------------
    rank: int = _opt(0, "this process's rank", env="RANK")
    world_size: int = _opt(1, "number of processes in the gang", env="WORLD_SIZE")
    local_rank: int = _opt(0, "rank on this machine (offsets --metrics-port)", env="LOCAL_RANK")
    local_world_size: int = _opt(1, "processes on this machine", env="LOCAL_WORLD_SIZE")
    master_addr: str = _opt("127.0.0.1", "host of rank 0's rendezvous store", env="MASTER_ADDR")
    master_port: int = _opt(29500, "port of rank 0's rendezvous store", env="MASTER_PORT")
    generation: int = _opt(
        0, "gang generation; workers of another generation refuse to join", env="DTJOB_GENERATION"
    )
    job_name: str = _opt("", "name of the DistributedTrainingJob (labels only)", env="DTJOB_JOB_NAME")
    namespace: str = _opt("", "namespace of the job (labels only)", env="DTJOB_NAMESPACE")

    @property
    def stages(self) -> int:
        """Pipeline stages of one replica: --pipeline-stages under --strategy pipeline, else 1."""
        return self.pipeline_stages if self.strategy == "pipeline" else 1

    @property
    def data_parallel_size(self) -> int:
        """Replicas that split the global batch (the T x P processes of one replica share a slice)."""
        return self.world_size // (self.stages * self.tensor_parallel)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainerConfig)}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    env: str | None = _FIELDS[name].metadata["env"]
    return env if env else "DTJOB_" + name.upper()


def _where(name: str) -> str:
    return f"{flag_of(name)} (env {env_of(name)})"


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _field_type(f: dataclasses.Field[Any]) -> type:
    text = str(f.type)
    for name, kind in (("int", int), ("float", float), ("bool", bool)):
        if text.startswith(name):
            return kind
    return str


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m dtjob.trainer",
        allow_abbrev=False,
        description="dtjob trainer: one worker of an elastic distributed training job.",
        epilog="Every flag can also be set from the environment variable shown in its help.",
    )
    for name, f in _FIELDS.items():
        meta = f.metadata
        help_ = f"{meta['help']} [env {env_of(name)}; default {f.default}]"
        # Defaults are applied later (flag > env > default), so every flag parses to None when absent.
        metavar = "{" + ",".join(meta["choices"]) + "}" if meta["choices"] else name.upper()
        parser.add_argument(flag_of(name), dest=name, metavar=metavar, default=None, help=help_)
    return parser


def _convert(name: str, raw: str, source: str) -> Any:
    f = _FIELDS[name]
    kind = _field_type(f)
    choices: Sequence[str] | None = f.metadata["choices"]
    try:
        value: Any = _BOOLS[raw.lower()] if kind is bool else kind(raw)
    except (ValueError, KeyError):
        expected = "true or false" if kind is bool else kind.__name__
        raise ConfigError(f"{source}: expected {expected}, got {raw!r}") from None
    if choices is not None and value not in choices:
        raise ConfigError(f"{source}: unknown value {raw!r}; choose one of {', '.join(choices)}") from None
    return value


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> TrainerConfig:
    """Build and check the configuration from flags and environment; raise `ConfigError`."""
    env = os.environ if environ is None else environ
    args = vars(_parser().parse_args(list(argv)))
    try:
        pod = contract.PodEnv.from_environ(env)
    except contract.PodEnvError as err:
        raise ConfigError(str(err)) from None
    values: dict[str, Any] = {}
    for name in _FIELDS:
        if name in _POD_DECLARED:
            values.update(_declared(name, args[name], env, pod))
        elif args[name] is not None:
            values[name] = _convert(name, args[name], f"flag {flag_of(name)}")
        elif env_of(name) in contract.ENVIRONMENT:  # the pod's: typed and checked by the contract
            values[name] = pod.value(env_of(name))
        elif env.get(env_of(name), "") != "":
            values[name] = _convert(name, env[env_of(name)], f"environment variable {env_of(name)}")
    config = TrainerConfig(**values)
    validate(config)
    _check_pod(config, pod, local_known=env.get(contract.ENV_LOCAL_WORLD_SIZE, "") != "")
    return config


# Fields the job's spec.parallelism declares (the operator sets these variables only where the
# spec has it): the declared value is the field's, and a flag or the field's own variable must agree.
_POD_DECLARED = {
    "tensor_parallel": ("tensor", contract.ENV_PARALLELISM_TENSOR),
    "pipeline_stages": ("pipeline", contract.ENV_PARALLELISM_PIPELINE),
}


def _declared(name: str, raw: str | None, env: Mapping[str, str], pod: contract.PodEnv) -> dict[str, Any]:
    field_name, variable = _POD_DECLARED[name]
    declared = pod.value(variable)
    given, where = None, ""
    if raw is not None:
        where = f"flag {flag_of(name)}"
        given = _convert(name, raw, where)
    elif env.get(env_of(name), "") != "":
        where = f"environment variable {env_of(name)}"
        given = _convert(name, env[env_of(name)], where)
    if given is not None and declared is not None and given != declared:
        raise ConfigError(
            f"{where}={given} disagrees with the job's spec.parallelism.{field_name}={declared} "
            f"(env {variable}); drop it or make them equal"
        )
    value = given if given is not None else declared
    return {} if value is None else {name: value}


def _check_pod(c: TrainerConfig, pod: contract.PodEnv, *, local_known: bool) -> None:
    """The checks against the pod: the processes per pod, and the pipeline the job declares."""
    if local_known:
        _require(
            c.local_world_size % c.tensor_parallel == 0,
            f"{_where('tensor_parallel')}={c.tensor_parallel} does not divide the {c.local_world_size} "
            f"processes per pod (LOCAL_WORLD_SIZE, spec.nprocPerWorker): a tensor-parallel group stays "
            f"inside one pod; use a divisor of {c.local_world_size} or raise spec.nprocPerWorker",
        )
    stages = pod.parallelism_pipeline
    _require(
        stages is None or stages == 1 or c.strategy == "pipeline",
        f"the job's spec.parallelism.pipeline={stages} (env {contract.ENV_PARALLELISM_PIPELINE}) needs "
        f"--strategy pipeline, not {c.strategy}; change the flag or spec.parallelism.pipeline",
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(c: TrainerConfig) -> None:
    """The checks between fields; each message names the flag(s) and the fix."""
    for name in ("layers", "dim", "heads", "seq_len", "steps", "global_batch_size", "world_size"):
        _require(getattr(c, name) >= 1, f"{_where(name)} must be at least 1, got {getattr(c, name)}")
    for name in ("warmup_steps", "checkpoint_every", "seed", "rank", "local_rank", "generation"):
        _require(getattr(c, name) >= 0, f"{_where(name)} must be 0 or more, got {getattr(c, name)}")
    if c.data and not is_factory(c.data):
        _require(os.path.exists(c.data), f"{_where('data')} {c.data}: no such file or directory")
    _require(
        c.model in ("gpt", "mlp") or is_factory(c.model),
        f"{_where('model')}: {c.model!r} is neither gpt, mlp nor pkg.module:factory",
    )
    _require(c.grad_accum >= 1, f"{_where('grad_accum')} must be at least 1, got {c.grad_accum}")
    _require(
        c.bucket_mb > 0 and c.first_bucket_mb > 0,
        f"{_where('bucket_mb')} and {_where('first_bucket_mb')} must be positive",
    )
    _require(c.peak_tflops >= 0, f"{_where('peak_tflops')} must be 0 (look up) or positive")
    _require(
        c.grad_compression == "none" or c.strategy == "ddp",
        f"{_where('grad_compression')} is for --strategy ddp only (use --precision bf16 for the others)",
    )
    _require(c.keep_checkpoints >= 1, f"{_where('keep_checkpoints')} must be at least 1")
    _require(c.grad_clip >= 0, f"{_where('grad_clip')} must be 0 (off) or positive, got {c.grad_clip}")
    _require(c.lr > 0 and c.min_lr >= 0, f"{_where('lr')} must be > 0 and {_where('min_lr')} >= 0")
    _require(0 <= c.metrics_port < 65536, f"{_where('metrics_port')} must be a port number, or 0 for off")
    _require(0 < c.master_port < 65536, f"{_where('master_port')} must be a port number")
    _require(c.collective_timeout > 0, f"{_where('collective_timeout')} must be positive seconds")
    _require(c.rendezvous_timeout > 0, f"{_where('rendezvous_timeout')} must be positive seconds")
    _require(
        c.rank < c.world_size,
        f"{_where('rank')}={c.rank} must be below {_where('world_size')}={c.world_size}",
    )
    if c.strategy == "fsdp":
        _require(c.zero_stage in (1, 2, 3), f"{_where('zero_stage')} must be 1, 2 or 3, got {c.zero_stage}")
    if c.strategy == "pipeline":
        _require(
            c.grad_accum == 1, f"{_where('grad_accum')}: the pipeline's micro-batches already accumulate"
        )
    if c.model == "gpt":
        _require(
            c.dim % c.heads == 0, f"{_where('dim')}={c.dim} must be divisible by {_where('heads')}={c.heads}"
        )
    _validate_tensor_parallel(c)
    replicas = c.data_parallel_size
    if c.strategy != "pipeline" and c.global_batch_size % replicas == 0:
        per_rank = c.global_batch_size // replicas
        _require(
            per_rank % c.grad_accum == 0,
            f"{_where('global_batch_size')}={c.global_batch_size} gives {per_rank} samples per rank, not "
            f"divisible by {_where('grad_accum')}={c.grad_accum}",
        )
    if c.strategy == "pipeline":
        _require(c.pipeline_stages >= 1, f"{_where('pipeline_stages')} must be at least 1")
        _require(
            c.world_size % c.pipeline_stages == 0,
            f"WORLD_SIZE={c.world_size} is not a multiple of "
            f"{_where('pipeline_stages')}={c.pipeline_stages}; run a multiple of the stage count",
        )
        _require(c.microbatches >= 1, f"{_where('microbatches')} must be at least 1")
        # The pipeline cuts the model's blocks: GPT = embedding + layers + head, MLP = embedding + layers.
        if c.model in ("gpt", "mlp") and not c.split:
            blocks = c.layers + (2 if c.model == "gpt" else 1)
            _require(
                c.pipeline_stages <= blocks,
                f"{_where('pipeline_stages')}={c.pipeline_stages} exceeds the {blocks} blocks of the model; "
                f"raise {_where('layers')} or use fewer stages",
            )
    _require(
        c.global_batch_size % replicas == 0,
        f"{_where('global_batch_size')}={c.global_batch_size} is not divisible by the {replicas} "
        f"data-parallel replicas (WORLD_SIZE={c.world_size} / (tensor x pipeline)); use a multiple of "
        f"{replicas}",
    )
    if c.strategy == "pipeline":
        per_replica = c.global_batch_size // replicas
        _require(
            per_replica % c.microbatches == 0,
            f"{_where('global_batch_size')}={c.global_batch_size} gives {per_replica} samples per replica, "
            f"not divisible by {_where('microbatches')}={c.microbatches}",
        )


def _validate_tensor_parallel(c: TrainerConfig) -> None:
    """--tensor-parallel T: the world holds whole TP groups, and the model can be split T ways."""
    T = c.tensor_parallel
    _require(T >= 1, f"{_where('tensor_parallel')} must be at least 1, got {T}")
    if T == 1:
        return
    _require(
        c.world_size % T == 0,
        f"WORLD_SIZE={c.world_size} is not a multiple of {_where('tensor_parallel')}={T}; run a "
        "multiple of it (spec.parallelism.tensor divides spec.nprocPerWorker)",
    )
    # A replica is T x P processes (--strategy pipeline): T and P each dividing it is not enough.
    _require(
        c.world_size % (T * c.stages) == 0,
        f"WORLD_SIZE={c.world_size} is not a multiple of {_where('tensor_parallel')}={T} x "
        f"{_where('pipeline_stages')}={c.stages}; run a multiple of {T * c.stages}",
    )
    _require(
        c.model != "mlp",
        f"{_where('tensor_parallel')}={T}: --model mlp has no tensor-parallel plan; use --model gpt, or "
        "your own loop with ElasticSession and tensor_parallel(model, plan={...}) with an explicit plan",
    )
    if c.model == "gpt":
        _require(
            c.heads % T == 0,
            f"{_where('heads')}={c.heads} is not divisible by {_where('tensor_parallel')}={T}: each "
            "rank runs whole attention heads; use a multiple of it",
        )


def is_factory(text: str) -> bool:
    """Whether `text` names user code as pkg.module:callable."""
    module, sep, name = text.partition(":")
    return (
        bool(sep)
        and bool(module)
        and name.isidentifier()
        and all(p.isidentifier() for p in module.split("."))
    )
