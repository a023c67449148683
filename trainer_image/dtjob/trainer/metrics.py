"""Prometheus metrics of one trainer process, served on `--metrics-port` + LOCAL_RANK.

The operator scrapes the gauges named in `dtjob.contract` (step, last checkpoint step and time)
from rank 0 to fill the job's status. Every
metric lives in a registry of its own (not the process-global default), so tests can build
several `TrainerMetrics` in one interpreter.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from dtjob import contract


class TrainerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.step = Gauge(contract.METRIC_STEP, "last completed optimizer step", registry=r)
        self.total_steps = Gauge(contract.METRIC_TOTAL_STEPS, "optimizer steps of the whole run", registry=r)
        self.loss = Gauge("dtjob_trainer_loss", "global mean loss of the last step", registry=r)
        self.learning_rate = Gauge(
            "dtjob_trainer_learning_rate", "learning rate of the last step", registry=r
        )
        self.samples_per_second = Gauge(
            "dtjob_trainer_samples_per_second", "global samples per second of the last step", registry=r
        )
        self.tokens_per_second = Gauge(
            contract.METRIC_TOKENS_PER_SECOND, "global tokens per second of the last step", registry=r
        )
        self.world_size = Gauge(contract.METRIC_WORLD_SIZE, "processes in the gang", registry=r)
        self.generation = Gauge(contract.METRIC_GENERATION, "gang generation (DTJOB_GENERATION)", registry=r)
        self.rank = Gauge("dtjob_trainer_rank", "this process's rank", registry=r)
        self.in_place_restarts = Gauge(
            contract.METRIC_IN_PLACE_RESTARTS,
            "restarts in place of the gang in this generation before this process started "
            "(DTJOB_IN_PLACE_RESTARTS); cause: what failed before the last one",
            ("cause",),
            registry=r,
        )
        self.in_place_restart_failed_at = Gauge(
            contract.METRIC_IN_PLACE_RESTART_FAILED_AT,
            "when the failure before the last restart in place was seen (DTJOB_RESTART_FAILED_AT)",
            registry=r,
        )
        self.last_checkpoint_step = Gauge(
            contract.METRIC_LAST_CHECKPOINT_STEP,
            "step of the newest checkpoint written or loaded",
            registry=r,
        )
        self.last_checkpoint_timestamp = Gauge(
            contract.METRIC_LAST_CHECKPOINT_TIME,
            "unix time the newest checkpoint was written (or, after a resume, was originally written)",
            registry=r,
        )
        self.checkpoint_save_seconds = Gauge(
            "dtjob_trainer_checkpoint_save_seconds", "duration of the last checkpoint save", registry=r
        )
        self.checkpoint_load_seconds = Gauge(
            "dtjob_trainer_checkpoint_load_seconds", "duration of the checkpoint load at start", registry=r
        )
        self.step_seconds = Gauge("dtjob_trainer_step_seconds", "wall time of the last step", registry=r)
        self.resumed_step = Gauge(
            contract.METRIC_RESUMED_STEP, "the step this process resumed from", registry=r
        )
        self.resumed_state_time = Gauge(
            contract.METRIC_RESUMED_STATE_TIME, "when the state it resumed from was written", registry=r
        )
        self.resume_lost_step = Gauge(
            contract.METRIC_RESUME_LOST_STEP,
            "the newest snapshot step a resume could not restore from memory (0: none lost)",
            registry=r,
        )
        self.snapshot_seconds = Gauge(
            contract.METRIC_SNAPSHOT_SECONDS,
            "seconds the last snapshot took its thread (serialize, write, buddy copy)",
            registry=r,
        )
        self.snapshot_bytes = Gauge(
            contract.METRIC_SNAPSHOT_BYTES,
            "bytes of one snapshot held in host memory: this rank's own, and the buddy copy it keeps",
            ("copy",),
            registry=r,
        )
        self.snapshot_step = Gauge(
            contract.METRIC_SNAPSHOT_STEP, "the newest step whose snapshot this rank completed", registry=r
        )
        self.first_step_time = Gauge(
            contract.METRIC_FIRST_STEP_TIME, "when this process completed its first step", registry=r
        )
        self.model_flops_utilization = Gauge(
            contract.METRIC_MFU,
            "model FLOPs per second of the last step over the device's peak (0..1; absent when unknown)",
            registry=r,
        )
        gpu = ("device",)
        self.gpu_memory_allocated = Gauge(
            "dtjob_trainer_gpu_memory_allocated_bytes", "GPU memory held by tensors", gpu, registry=r
        )
        self.gpu_memory_reserved = Gauge(
            "dtjob_trainer_gpu_memory_reserved_bytes",
            "GPU memory held by the caching allocator",
            gpu,
            registry=r,
        )
        self.gpu_memory_peak = Gauge(
            "dtjob_trainer_gpu_memory_peak_bytes",
            "most GPU memory held by tensors since the start",
            gpu,
            registry=r,
        )
        self.checkpoints_saved = Counter("dtjob_trainer_checkpoints_saved", "checkpoints written", registry=r)
        self.checkpoint_write_failures = Gauge(
            contract.METRIC_CHECKPOINT_FAILURES,
            "checkpoint writes that failed on the volume since the last one that succeeded",
            registry=r,
        )
        labels = ("op", "algorithm")
        self.collective_bytes = Counter(
            "dtjob_trainer_collective_bytes",
            "bytes of tensors passed to collectives and pipeline sends/receives",
            labels,
            registry=r,
        )
        self.collective_seconds = Counter(
            "dtjob_trainer_collective_seconds",
            "seconds collectives and pipeline sends/receives were in flight",
            labels,
            registry=r,
        )
        self.collective_calls = Counter(
            "dtjob_trainer_collective_calls",
            "collective (and pipeline send/receive) calls",
            labels,
            registry=r,
        )
        self.port: int | None = None

    def serve(self, port: int) -> None:
        """Serve /metrics on all interfaces from a daemon thread."""
        start_http_server(port, registry=self.registry)
        self.port = port

    def observe_gpu_memory(self, device: object) -> None:
        """Allocated, reserved and peak memory of a CUDA device (reads counters, no synchronisation)."""
        import torch

        label = str(device)
        self.gpu_memory_allocated.labels(label).set(torch.cuda.memory_allocated(device))  # type: ignore[arg-type]
        self.gpu_memory_reserved.labels(label).set(torch.cuda.memory_reserved(device))  # type: ignore[arg-type]
        self.gpu_memory_peak.labels(label).set(torch.cuda.max_memory_allocated(device))  # type: ignore[arg-type]

    def observe_collective(self, op: str, algorithm: str, nbytes: int, seconds: float) -> None:
        self.collective_bytes.labels(op, algorithm).inc(nbytes)
        self.collective_seconds.labels(op, algorithm).inc(seconds)
        self.collective_calls.labels(op, algorithm).inc()
