"""`ParallelConfig`: every knob of the parallel strategies, validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("ddp", "fsdp", "pipeline")
SCHEDULES = ("gpipe", "1f1b")
COLLECTIVES = ("auto", "ring", "hd", "direct", "native")
PRECISIONS = ("fp32", "bf16")
COMPRESSIONS = ("none", "bf16", "fp16")


@dataclass(frozen=True)
class ParallelConfig:
    """How `parallelize` spreads one model over the ranks of the default process group.

    strategy: "ddp" (replicate, all-reduce gradients), "fsdp" (ZeRO: shard state, see zero_stage)
        or "pipeline" (cut the model's blocks into pipeline_stages stages; world sizes that are
        multiples of pipeline_stages add data parallelism across pipeline replicas).
    zero_stage: fsdp only. 1 shards optimizer state; 2 also keeps only this rank's gradient shard
        (reduce-scatter); 3 also shards the parameters, gathering each block's just in time.
    pipeline_stages: pipeline only. Number of stages P; the world size must be a multiple of P and
        the model must have at least P blocks.
    microbatches: pipeline only. Micro-batches M per replica per step; the replica's batch must
        split into M equal parts. The idle share of a step (bubble) is (P-1)/(M+P-1).
    schedule: pipeline only. "gpipe" (all forwards, then all backwards: M micro-batches of
        activations alive) or "1f1b" (one forward one backward: at most P alive).
    collective: "ring", "hd" (halving-doubling), "direct" (pairwise exchange; its broadcasts use
        "auto") or "auto" run dtjob.trainer.collectives with that algorithm; "native" runs
        torch.distributed's own collectives (gloo/nccl).
    precision: "fp32", or "bf16" (compute in bfloat16 under autocast; weights, optimizer state,
        gradients and their reduction stay fp32).
    grad_clip: clip the global gradient norm (over all ranks and shards) to this value, or None.
    grad_accum: micro-steps per optimizer step: each rank's batch is cut into grad_accum parts,
        run one after the other; DDP and ZeRO-1 communicate only after the last (no_sync).
    activation_checkpointing: recompute each block's activations in backward instead of storing
        them (every strategy; blocks are the model's blocks_in_order()).
    ddp_bucket_mb / ddp_first_bucket_mb: DDP gradient bucket caps in MiB (torch's defaults: the
        first bucket small so communication starts early, the rest larger to amortise latency).
    grad_compression: DDP only. "bf16" or "fp16" halves the all-reduce bytes (gradients are
        pre-divided by the world size so fp16 does not overflow); "none" sends fp32.
    zero3_prefetch: ZeRO-3 only. Start gathering the next block's parameters while the current
        block computes.
    """

    strategy: str = "ddp"
    zero_stage: int = 3
    pipeline_stages: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    collective: str = "auto"
    precision: str = "fp32"
    grad_clip: float | None = None
    grad_accum: int = 1
    activation_checkpointing: bool = False
    ddp_bucket_mb: float = 25.0
    ddp_first_bucket_mb: float = 1.0
    grad_compression: str = "none"
    zero3_prefetch: bool = True

    def __post_init__(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"ParallelConfig.{name} must be one of {allowed}, got {value!r}")

        choice("strategy", STRATEGIES)
        choice("schedule", SCHEDULES)
        choice("collective", COLLECTIVES)
        choice("precision", PRECISIONS)
        choice("grad_compression", COMPRESSIONS)
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage must be 1, 2 or 3, got {self.zero_stage!r}")
        for name in ("pipeline_stages", "microbatches", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"ParallelConfig.grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not (self.ddp_bucket_mb > 0 and self.ddp_first_bucket_mb > 0):
            raise ValueError("ParallelConfig.ddp_bucket_mb and ddp_first_bucket_mb must be > 0")
        if self.grad_compression != "none" and self.strategy != "ddp":
            raise ValueError(
                f"ParallelConfig.grad_compression={self.grad_compression!r} is only for strategy='ddp' "
                "(use precision='bf16' for fsdp/pipeline)"
            )
