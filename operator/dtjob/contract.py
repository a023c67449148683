"""The contract between the dtjob operator and the processes in its worker pods.

One module, imported by both sides (it imports neither torch nor kopf), so a name or a number
changes in one place. A trainer that is not dtjob's honours the part it can: the environment is
torchrun's, and exit code 0 / non-zero means what it means everywhere. The rest (exit 75 after a
checkpoint, the metrics, the closing log line) lets the operator know more; without it the
operator still runs the job and says in the job's status what it cannot see.

Environment of every trainer process (the operator sets the pod-level ones; dtjob's launcher in
the pod derives the per-process ones when a pod runs several processes):
    MASTER_ADDR, MASTER_PORT      rank 0's rendezvous store (rank 0's pod DNS name, spec.masterPort)
    WORLD_SIZE, RANK              processes in the gang, this process's rank
    LOCAL_RANK, LOCAL_WORLD_SIZE  rank inside the pod, processes per pod (spec.nprocPerWorker)
    DTJOB_*                       the names below

Every process reads this environment through `PodEnv.from_environ()`: typed, checked, with
the defaults of a process started without an operator (one process, rank 0, 127.0.0.1:29500).

Exit codes: see the EXIT_* constants.

Metrics: every process serves Prometheus text on DTJOB_METRICS_PORT + LOCAL_RANK; the operator
reads the gauges in METRIC_* from global rank 0.

Peer-lost line: a process that exits EXIT_PEER_LOST logs `peer_lost_line(...)` before it leaves;
the operator names the lost rank from it.

Closing line: rank 0 logs `complete_line(...)` to stderr as its last line when training is
complete; the operator reads it from the finished pod's log (its metrics endpoint is gone by then).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

# --- exit codes ------------------------------------------------------------------------------
EXIT_OK = 0  # training complete
EXIT_FAILURE = 1  # any failure not named below
EXIT_CONFIG_ERROR = 2  # bad flags, environment or user code; restarting will not help
EXIT_STALE_GENERATION = 3  # this worker belongs to another generation of the gang than its peers
EXIT_STOPPED = 75  # stopped on SIGTERM after a checkpoint (EX_TEMPFAIL): restart to continue
EXIT_PEER_LOST = 76  # a peer stopped answering; this process left so the gang can restart

# --- environment -----------------------------------------------------------------------------
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_JOB_NAME = "DTJOB_JOB_NAME"
ENV_NAMESPACE = "DTJOB_NAMESPACE"
ENV_GENERATION = "DTJOB_GENERATION"
ENV_CHECKPOINT_DIR = "DTJOB_CHECKPOINT_DIR"
ENV_METRICS_PORT = "DTJOB_METRICS_PORT"
# The job's metadata.uid: with the generation it names the gang that may write checkpoints
# (trainer/fence.py: a replaced gang still running stops).
ENV_JOB_UID = "DTJOB_JOB_UID"
# Pod rank and pod count: a pod of LOCAL_WORLD_SIZE processes holds global ranks
# POD_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK; WORLD_SIZE = PODS * LOCAL_WORLD_SIZE.
ENV_POD_RANK = "DTJOB_POD_RANK"
ENV_PODS = "DTJOB_PODS"
ENV_DEVICE = "DTJOB_DEVICE"  # auto | cpu | cuda
# Seconds a rank's heartbeat may be silent before the others declare it lost and exit
# EXIT_PEER_LOST (spec.elastic.heartbeatTimeoutSeconds).
ENV_HEARTBEAT_TIMEOUT = "DTJOB_HEARTBEAT_TIMEOUT"
# Restarts in place (dtjob.launcher; spec.elastic.restartInPlace): pod 0's agent coordinates them
# on this port (spec.masterPort + 1); unset, a failed trainer fails its pod.
ENV_AGENT_PORT = "DTJOB_AGENT_PORT"
# How many restarts in place the gang may still make (elastic.maxRestarts - status.restarts when
# the generation was created), and the exit codes that are never restarted in place (comma list).
ENV_RESTARTS_LEFT = "DTJOB_RESTARTS_LEFT"
ENV_PERMANENT_EXIT_CODES = "DTJOB_PERMANENT_EXIT_CODES"
# Given to the trainers of a round restarted in place: the restarts in place of this generation
# so far, and what failed before the last one ("rank 1 (pod 1) exited 137 (SIGKILL)").
ENV_IN_PLACE_RESTARTS = "DTJOB_IN_PLACE_RESTARTS"
ENV_RESTART_CAUSE = "DTJOB_RESTART_CAUSE"
ENV_RESTART_FAILED_AT = "DTJOB_RESTART_FAILED_AT"
# In-memory snapshots (trainer/snapshot.py): where (a tmpfs the trainer processes do not own:
# it survives them, not the pod), every how many steps (0: off), and the bytes of host memory
# they may take per pod (0: the container's cgroup limit, memory.max).
ENV_SNAPSHOT_DIR = "DTJOB_SNAPSHOT_DIR"
ENV_SNAPSHOT_EVERY = "DTJOB_SNAPSHOT_EVERY"
ENV_SNAPSHOT_MEMORY_LIMIT = "DTJOB_SNAPSHOT_MEMORY_LIMIT"
# Where the operator mounts a memory-backed emptyDir for them (a pod's own /dev/shm is 64 MiB).
DEFAULT_SNAPSHOT_DIR = "/dev/shm/dtjob-snapshots"
# spec.parallelism (#44): the tensor-parallel size (the processes of a pod split each layer) and
# the pipeline stages of one data-parallel replica; set only where the spec has parallelism. The
# built-in trainer takes them as the values of --tensor-parallel and --pipeline-stages (a flag, or
# its own DTJOB_TENSOR_PARALLEL / DTJOB_PIPELINE_STAGES, must agree).
ENV_PARALLELISM_TENSOR = "DTJOB_PARALLELISM_TENSOR"
ENV_PARALLELISM_PIPELINE = "DTJOB_PARALLELISM_PIPELINE"

# --- metrics (gauges) --------------------------------------------------------------------------
METRIC_STEP = "dtjob_trainer_step"
METRIC_LAST_CHECKPOINT_STEP = "dtjob_trainer_last_checkpoint_step"
METRIC_LAST_CHECKPOINT_TIME = "dtjob_trainer_last_checkpoint_timestamp_seconds"
# Checkpoint writes that failed on the volume since the last one that succeeded (0 after a success).
METRIC_CHECKPOINT_FAILURES = "dtjob_trainer_checkpoint_write_failures"
METRIC_WORLD_SIZE = "dtjob_trainer_world_size"
METRIC_GENERATION = "dtjob_trainer_generation"
# DTJOB_IN_PLACE_RESTARTS of the trainer, with its DTJOB_RESTART_CAUSE as the label `cause`.
METRIC_IN_PLACE_RESTARTS = "dtjob_trainer_in_place_restarts"
# DTJOB_RESTART_FAILED_AT: when the failure before the last restart in place was seen (unix
# seconds), so that the job's recovery counts its downtime from the failure, not from the first
# scrape of the new rank 0 (1-2 s later: the restart itself).
METRIC_IN_PLACE_RESTART_FAILED_AT = "dtjob_trainer_in_place_restart_failed_at_seconds"
# Progress for the job's status.progress and eta (#43): the run's total steps, and rank 0's last
# step's global tokens per second and MFU (0..1, absent when the device's peak is unknown).
METRIC_TOTAL_STEPS = "dtjob_trainer_total_steps"
# When this process completed its first step (unix seconds): the end of the recovery before it,
# exact, where the operator's next scrape sees the step up to a scrape interval (1-8 s) later.
METRIC_FIRST_STEP_TIME = "dtjob_trainer_first_step_timestamp_seconds"
# The step this process resumed from and when that state was written: the steps a new gang redid
# and when a planned stop's old gang stopped, which its newest checkpoint no longer tells once
# the new gang has written one (a scrape can come 8 s late, after it).
METRIC_RESUMED_STEP = "dtjob_trainer_resumed_step"
METRIC_RESUMED_STATE_TIME = "dtjob_trainer_resumed_state_timestamp_seconds"
# A restart that wanted a newer step from memory than it got: the newest step the gang's in-memory
# snapshots held but could not restore (both copies of a shard lost with two pods, or damaged), so
# it resumed from the durable checkpoint of METRIC_RESUMED_STEP instead (0: nothing was lost). The
# operator turns it into the event RecoveredFromCheckpoint.
METRIC_RESUME_LOST_STEP = "dtjob_trainer_resume_lost_step"
# In-memory snapshots, per rank (snapshot.py): the seconds the last one took its thread (serialize,
# write, buddy exchange), the bytes held in host memory (label `copy`: own, buddy) and the newest
# step this rank holds complete.
METRIC_SNAPSHOT_SECONDS = "dtjob_trainer_snapshot_seconds"
METRIC_SNAPSHOT_BYTES = "dtjob_trainer_snapshot_bytes"
METRIC_SNAPSHOT_STEP = "dtjob_trainer_snapshot_step"
METRIC_TOKENS_PER_SECOND = "dtjob_trainer_tokens_per_second"
METRIC_MFU = "dtjob_trainer_model_flops_utilization"

# --- the peer-lost line --------------------------------------------------------------------------
# A process leaving with EXIT_PEER_LOST logs `peer_lost_line(rank, seconds)` first; the operator
# reads it from the pod's log to name the lost rank in the job's event.
_PEER_LOST = re.compile(r"peer lost: rank (\d+)")


def peer_lost_line(rank: int, silent_seconds: float) -> str:
    """The line a process logs before it exits EXIT_PEER_LOST because `rank` went silent."""
    return f"peer lost: rank {rank} silent for {silent_seconds:.1f}s"


def peer_failed_line(rank: int, why: str) -> str:
    """The line a process logs before it exits EXIT_PEER_LOST because `rank` failed and said so
    (its error, issue #40): the same prefix, so parse_peer_lost_line names the rank."""
    return f"peer lost: rank {rank} failed: {why}"


def parse_peer_lost_line(text: str) -> int | None:
    """The lost rank named by the last peer-lost line in `text` (a log tail), or None."""
    return _last_number(_PEER_LOST, text)


def _last_number(pattern: re.Pattern[str], text: str) -> int | None:
    """The number the last match of `pattern` in `text` captured, or None (a log tail may hold
    several such lines: the newest counts)."""
    found = None
    for match in pattern.finditer(text):
        found = match
    return None if found is None else int(found.group(1))


# --- the agent's last line ----------------------------------------------------------------------
# A pod agent that restarts in place (dtjob.launcher) logs `in_place_line(n)` as its last line when
# it leaves failing: the operator counts the n restarts in place of the generation from it, as
# rank 0's metrics may not have shown the last ones.
_IN_PLACE = re.compile(r"restarts in place in this generation: (\d+)")


def in_place_line(restarts: int) -> str:
    return f"restarts in place in this generation: {restarts}"


def parse_in_place_line(text: str) -> int | None:
    """The count of the last `in_place_line` in `text` (a log tail), or None."""
    return _last_number(_IN_PLACE, text)


# --- a failed worker's last words ------------------------------------------------------------
# The operator puts a failed worker's last log line on the job's event and condition, so that a
# failure says why without `kubectl logs` (issue #46). Bookkeeping lines of this contract (the
# agent's in-place count) are skipped; 300 characters keep an event readable (a traceback's last
# line, the exception, fits).
LAST_WORDS_CHARS = 300


def last_words(text: str) -> str | None:
    """The last line of `text` (a log tail or termination message) that says something, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and _IN_PLACE.search(line) is None:
            return line if len(line) <= LAST_WORDS_CHARS else line[: LAST_WORDS_CHARS - 3] + "..."
    return None


# --- the closing log line ------------------------------------------------------------------------
_COMPLETE = re.compile(r"training complete at step (\d+)(?:; last checkpoint step (\d+) at ([\d.]+))?")


@dataclass(frozen=True)
class Completion:
    """What rank 0's closing line says."""

    step: int
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None  # unix seconds


def complete_line(step: int, checkpoint_step: int | None = None, checkpoint_time: float | None = None) -> str:
    """The closing line rank 0 logs when training is complete."""
    if checkpoint_step is None or checkpoint_time is None:
        return f"training complete at step {step}"
    tail = f"; last checkpoint step {checkpoint_step} at {checkpoint_time:.3f}"
    return f"training complete at step {step}{tail}"


def parse_complete_line(text: str) -> Completion | None:
    """The last closing line in `text` (a log tail), or None when there is none."""
    found = None
    for match in _COMPLETE.finditer(text):
        found = match
    if found is None:
        return None
    step, ckpt_step, ckpt_time = found.groups()
    return Completion(
        int(step),
        int(ckpt_step) if ckpt_step is not None else None,
        float(ckpt_time) if ckpt_time is not None else None,
    )


# --- liveness ----------------------------------------------------------------------------------
DEFAULT_HEARTBEAT_TIMEOUT = 10.0  # seconds: spec.elastic.heartbeatTimeoutSeconds' default


@dataclass(frozen=True)
class Liveness:
    """Every liveness timeout inside the pods, derived from one setting: `timeout` (T), the
    heartbeat timeout, spec.elastic.heartbeatTimeoutSeconds, given to every process as
    DTJOB_HEARTBEAT_TIMEOUT (`PodEnv.liveness`). docs/design.md's "who detects what" table is
    generated from these; the numbers in the comments are at the default T = 10 s.
    """

    timeout: float = DEFAULT_HEARTBEAT_TIMEOUT

    # The trainer heartbeat (trainer/heartbeat.py) beats HEARTBEAT_BEATS_PER_TIMEOUT times per T, at
    # most HEARTBEAT_MAX_BEAT_SECONDS apart; it sees a peer's last beat up to a beat late, so a
    # lost rank is named within T + 2 beats (12 s; at 1 s beats and T = 4 s, the chaos runs found
    # hangs 4.6-6.1 s after the fault).
    HEARTBEAT_BEATS_PER_TIMEOUT: ClassVar[int] = 8
    HEARTBEAT_MAX_BEAT_SECONDS: ClassVar[float] = 1.0
    # A pod's agent is taken for gone (its pod frozen, its network cut) after 0.3 T of silence
    # (3 s), and so is the coordinator by an agent: well inside T, so when the survivors' heartbeat
    # names a frozen pod's rank lost (T after the freeze) the coordinator already counts that pod
    # out and leaves the failure to the operator, not to a restart in place that pod cannot join.
    # Agents beat 6 times within it (every 0.5 s): a few late beats on a loaded pod are no loss.
    AGENT_TIMEOUT_PER_T: ClassVar[float] = 0.3
    AGENT_BEATS_PER_TIMEOUT: ClassVar[int] = 6
    # Every agent must have stopped its trainers T after a restart in place's stop (10 s), or the
    # coordinator gives the restart up: SIGKILL and reaping take milliseconds, a process stuck in
    # the kernel may never go.
    STOP_TIMEOUT_PER_T: ClassVar[float] = 1.0
    # An agent waits 1.5 T (15 s) for the coordinator's answer to its failure or its stopped: the
    # stop timeout and T / 2, so the coordinator's own give-up at the stop timeout reaches it first.
    ANSWER_TIMEOUT_PER_T: ClassVar[float] = 1.5

    @property
    def heartbeat_beat_seconds(self) -> float:
        return min(self.HEARTBEAT_MAX_BEAT_SECONDS, self.timeout / self.HEARTBEAT_BEATS_PER_TIMEOUT)

    @property
    def heartbeat_verdict_seconds(self) -> float:
        """The longest a lost rank takes to be named once it is gone: T and two beats."""
        return self.timeout + 2 * self.heartbeat_beat_seconds

    @property
    def agent_timeout_seconds(self) -> float:
        return self.AGENT_TIMEOUT_PER_T * self.timeout

    @property
    def agent_beat_seconds(self) -> float:
        return self.agent_timeout_seconds / self.AGENT_BEATS_PER_TIMEOUT

    @property
    def stop_timeout_seconds(self) -> float:
        return self.STOP_TIMEOUT_PER_T * self.timeout

    @property
    def answer_timeout_seconds(self) -> float:
        return self.ANSWER_TIMEOUT_PER_T * self.timeout


# --- reading the environment ------------------------------------------------------------------
DEVICES = ("auto", "cpu", "cuda")


class PodEnvError(ValueError):
    """A variable of the pod environment is malformed; the message names it and the form expected."""


@dataclass(frozen=True)
class _Form:
    """How a variable's text becomes its value, and the form named when it does not."""

    expected: str
    parse: Callable[[str], Any]


def _whole(minimum: int, maximum: int | None = None, expected: str = "") -> _Form:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(raw)
        return value

    return _Form(expected or f"a whole number >= {minimum}", parse)


def _one_of(choices: tuple[str, ...]) -> _Form:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw

    return _Form(f"one of {', '.join(choices)}", parse)


_TEXT = _Form("text", str)
_COUNT = _whole(0)
_SIZE = _whole(1)
_PORT = _whole(0, 65535, "a port number (0-65535)")
_AGENT_PORT = _Form(_PORT.expected, lambda raw: _PORT.parse(raw) or None)  # 0: none
_SECONDS = _Form("a number of seconds", float)
_CODES = _Form("a comma list of integers", lambda raw: frozenset(int(c) for c in raw.split(",") if c.strip()))


def _var(variable: str, default: Any, form: _Form) -> Any:
    """A field of PodEnv: read from `variable`; `default` when it is unset or empty."""
    return dataclasses.field(default=default, metadata={"variable": variable, "form": form})


@dataclass(frozen=True)
class PodEnv:
    """The environment of a trainer process (ENVIRONMENT below), typed and checked.

    `PodEnv.from_environ()` is the one place it is read: the gang, the trainer's configuration,
    the collectives, the heartbeat and the pod's launcher all ask it. Unset or empty, a variable
    has the default below, that of one process started by hand.
    """

    master_addr: str = _var(ENV_MASTER_ADDR, "127.0.0.1", _TEXT)
    master_port: int = _var(ENV_MASTER_PORT, 29500, _whole(1, 65535, "a port number (1-65535)"))
    world_size: int = _var(ENV_WORLD_SIZE, 1, _SIZE)
    rank: int = _var(ENV_RANK, 0, _COUNT)
    local_rank: int = _var(ENV_LOCAL_RANK, 0, _COUNT)
    local_world_size: int = _var(ENV_LOCAL_WORLD_SIZE, 1, _SIZE)
    # Unset: RANK // LOCAL_WORLD_SIZE and WORLD_SIZE // LOCAL_WORLD_SIZE (RANK is the pod's first).
    pod_rank: int = _var(ENV_POD_RANK, 0, _COUNT)
    pods: int = _var(ENV_PODS, 1, _SIZE)
    job_name: str = _var(ENV_JOB_NAME, "", _TEXT)
    namespace: str = _var(ENV_NAMESPACE, "", _TEXT)
    generation: int = _var(ENV_GENERATION, 0, _COUNT)
    job_uid: str = _var(ENV_JOB_UID, "", _TEXT)
    checkpoint_dir: str | None = _var(ENV_CHECKPOINT_DIR, None, _TEXT)  # None: no checkpoints
    metrics_port: int = _var(ENV_METRICS_PORT, 0, _PORT)  # 0: no metrics
    device: str = _var(ENV_DEVICE, "auto", _one_of(DEVICES))
    heartbeat_timeout: float = _var(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT, _SECONDS)  # <= 0: none
    agent_port: int | None = _var(ENV_AGENT_PORT, None, _AGENT_PORT)  # None: no restarts in place
    restarts_left: int = _var(ENV_RESTARTS_LEFT, 0, _COUNT)
    permanent_exit_codes: frozenset[int] = _var(ENV_PERMANENT_EXIT_CODES, frozenset(), _CODES)
    in_place_restarts: int = _var(ENV_IN_PLACE_RESTARTS, 0, _COUNT)
    restart_cause: str = _var(ENV_RESTART_CAUSE, "", _TEXT)
    restart_failed_at: float | None = _var(ENV_RESTART_FAILED_AT, None, _SECONDS)  # unix seconds
    snapshot_dir: str = _var(ENV_SNAPSHOT_DIR, DEFAULT_SNAPSHOT_DIR, _TEXT)
    snapshot_every: int = _var(ENV_SNAPSHOT_EVERY, 1, _COUNT)  # 0: no snapshots
    snapshot_memory_limit: int = _var(ENV_SNAPSHOT_MEMORY_LIMIT, 0, _COUNT)  # 0: the cgroup's
    parallelism_tensor: int | None = _var(ENV_PARALLELISM_TENSOR, None, _SIZE)  # None: not declared
    parallelism_pipeline: int | None = _var(ENV_PARALLELISM_PIPELINE, None, _SIZE)  # None: not declared

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> PodEnv:
        """Read `environ` (os.environ, read now); raise PodEnvError naming a malformed variable."""
        values = {
            f.name: _parse(f, environ[f.metadata["variable"]])
            for f in dataclasses.fields(cls)
            if environ.get(f.metadata["variable"], "") != ""
        }
        env = cls(**values)
        return dataclasses.replace(
            env,
            pod_rank=values.get("pod_rank", env.rank // env.local_world_size),
            pods=values.get("pods", max(1, env.world_size // env.local_world_size)),
        )

    @property
    def liveness(self) -> Liveness:
        """Every liveness timeout, from DTJOB_HEARTBEAT_TIMEOUT (the default T without a heartbeat)."""
        return Liveness(self.heartbeat_timeout if self.heartbeat_timeout > 0 else DEFAULT_HEARTBEAT_TIMEOUT)

    def value(self, variable: str) -> Any:
        """The value of `variable` (one of ENVIRONMENT's names)."""
        return getattr(self, _POD_ENV_FIELDS[variable])

    @staticmethod
    def read(variable: str, environ: Mapping[str, str] = os.environ) -> Any:
        """One variable, read and checked as from_environ does, for a caller on a hot path (the
        collectives ask LOCAL_WORLD_SIZE at every call: 1 lookup instead of 21). Not for
        DTJOB_POD_RANK and DTJOB_PODS, whose default follows from other variables."""
        if variable in _DERIVED:
            raise ValueError(f"{variable} unset follows from other variables: use PodEnv.from_environ()")
        f = _POD_ENV_META[variable]
        raw = environ.get(variable, "")
        return f.default if raw == "" else _parse(f, raw)


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    form: _Form = f.metadata["form"]
    try:
        return form.parse(raw)
    except ValueError:
        raise PodEnvError(
            f"environment variable {f.metadata['variable']}={raw!r} is not {form.expected}"
        ) from None


_POD_ENV_META = {f.metadata["variable"]: f for f in dataclasses.fields(PodEnv)}
_POD_ENV_FIELDS = {variable: f.name for variable, f in _POD_ENV_META.items()}
# Unset, these follow from others (PodEnv.from_environ); every other variable takes its default.
_DERIVED = {ENV_POD_RANK: "RANK / LOCAL_WORLD_SIZE", ENV_PODS: "WORLD_SIZE / LOCAL_WORLD_SIZE"}


def pod_env_form(variable: str) -> str:
    """What `variable` must hold and what unset means, as docs/design.md's table says it."""
    f = _POD_ENV_META[variable]
    default = f.default
    shown = _DERIVED.get(variable) or ("none" if default in (None, "", frozenset()) else str(default))
    return f"{f.metadata['form'].expected}; unset: {shown}"


# --- what each name means (docs/design.md's tables are generated from these) ----------------------
# Who sets a variable: the operator in the pod spec, dtjob's launcher per process, the pod's agent
# per round restarted in place, or the user in the job's template.
ENVIRONMENT: dict[str, tuple[str, str]] = {
    ENV_MASTER_ADDR: ("operator", "rank 0's pod DNS name: the rendezvous store's host"),
    ENV_MASTER_PORT: ("operator", "the rendezvous store's port (spec.masterPort)"),
    ENV_WORLD_SIZE: ("operator", "processes in the gang: DTJOB_PODS * LOCAL_WORLD_SIZE"),
    ENV_RANK: ("operator, launcher", "this process's global rank (the operator gives the pod's first)"),
    ENV_LOCAL_RANK: ("operator, launcher", "rank inside the pod (0 from the operator)"),
    ENV_LOCAL_WORLD_SIZE: ("operator", "processes per pod (spec.nprocPerWorker)"),
    ENV_POD_RANK: ("operator", "the pod's rank: RANK = POD_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK"),
    ENV_PODS: ("operator", "worker pods in the gang"),
    ENV_JOB_NAME: ("operator", "the job's metadata.name"),
    ENV_NAMESPACE: ("operator", "the job's namespace"),
    ENV_GENERATION: (
        "operator",
        "the gang's generation (status.generation): new at each restart in new pods",
    ),
    ENV_JOB_UID: ("operator", "the job's metadata.uid: with the generation, who may write checkpoints"),
    ENV_CHECKPOINT_DIR: ("operator", "where the checkpoint volume is mounted (spec.checkpoint.mountPath)"),
    ENV_METRICS_PORT: ("operator", "the Prometheus port of LOCAL_RANK 0 (0: none); local rank r: this + r"),
    ENV_DEVICE: ("user", "where the trainer computes (auto: CUDA where available, else the CPU)"),
    ENV_HEARTBEAT_TIMEOUT: (
        "operator",
        "a rank silent this long is lost (0: no heartbeat; elastic.heartbeatTimeoutSeconds)",
    ),
    ENV_AGENT_PORT: ("operator", "pod 0's agent's port (masterPort + 1); only with restarts in place"),
    ENV_RESTARTS_LEFT: ("operator", "restarts in place the gang may still make; only with restarts in place"),
    ENV_PERMANENT_EXIT_CODES: ("operator", "exit codes never restarted in place (comma list)"),
    ENV_IN_PLACE_RESTARTS: ("agent", "restarts in place of this generation so far"),
    ENV_RESTART_CAUSE: ("agent", "what failed before the last restart in place"),
    ENV_RESTART_FAILED_AT: ("agent", "when that failure was seen (unix seconds)"),
    ENV_SNAPSHOT_DIR: ("user", "in-memory snapshots' directory: a tmpfs that outlives the trainer processes"),
    ENV_SNAPSHOT_EVERY: ("user", "steps between in-memory snapshots (0: none)"),
    ENV_SNAPSHOT_MEMORY_LIMIT: ("user", "host bytes snapshots may take per pod (0: the cgroup's memory.max)"),
    ENV_PARALLELISM_TENSOR: (
        "operator",
        "spec.parallelism.tensor: processes of one pod that split each layer (only with spec.parallelism)",
    ),
    ENV_PARALLELISM_PIPELINE: (
        "operator",
        "spec.parallelism.pipeline: pipeline stages of one data-parallel replica (only with "
        "spec.parallelism)",
    ),
}

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "training complete",
    EXIT_FAILURE: "any failure not named below: the gang restarts (counted)",
    EXIT_CONFIG_ERROR: "bad flags, environment or user code: permanent under restartPolicy ExitCode",
    EXIT_STALE_GENERATION: "this process belongs to a replaced gang (trainer/fence.py): it stops",
    EXIT_STOPPED: "stopped on SIGTERM after a checkpoint: the gang restarts uncounted",
    EXIT_PEER_LOST: "a peer went silent or failed: the log names it (peer-lost line), the gang restarts",
}

# Gauges every trainer process serves; the operator reads global rank 0's.
METRICS: dict[str, str] = {
    METRIC_STEP: "the last optimizer step completed",
    METRIC_LAST_CHECKPOINT_STEP: "the step of the newest checkpoint written",
    METRIC_LAST_CHECKPOINT_TIME: "when it was written (unix seconds)",
    METRIC_CHECKPOINT_FAILURES: "checkpoint writes failed since the last success",
    METRIC_WORLD_SIZE: "processes in the gang",
    METRIC_GENERATION: "the gang's generation (DTJOB_GENERATION)",
    METRIC_IN_PLACE_RESTARTS: "DTJOB_IN_PLACE_RESTARTS, label `cause` = DTJOB_RESTART_CAUSE",
    METRIC_IN_PLACE_RESTART_FAILED_AT: "DTJOB_RESTART_FAILED_AT (absent before the first restart in place)",
    METRIC_TOTAL_STEPS: "the run's total steps (absent: not known to the trainer)",
    METRIC_FIRST_STEP_TIME: "when this process completed its first step (unix seconds; 0 before it)",
    METRIC_RESUMED_STEP: "the step this process resumed from (0: from the start)",
    METRIC_RESUMED_STATE_TIME: "when the state it resumed from was written (unix seconds; 0: none)",
    METRIC_RESUME_LOST_STEP: "the newest in-memory snapshot step a resume could not restore, so it resumed "
    "from the durable checkpoint instead (0: none lost)",
    METRIC_SNAPSHOT_SECONDS: "seconds the last in-memory snapshot took its thread (serialize, write, "
    "buddy copy)",
    METRIC_SNAPSHOT_BYTES: "bytes of one snapshot this rank keeps in host memory, label `copy` = own "
    "or buddy",
    METRIC_SNAPSHOT_STEP: "the newest step whose snapshot (own file and buddy copy) this rank completed",
    METRIC_TOKENS_PER_SECOND: "tokens per second over the recent steps",
    METRIC_MFU: "model FLOPs utilization, 0..1 (absent: the device's peak is unknown)",
}


# --- the operator's per-job metrics (#43) ---------------------------------------------------------
# Served by the operator (`dtjob operator --metrics-port`), labelled namespace and name (and cause
# where named): a bounded set of series per job, none per pod, removed when the job is deleted.
@dataclass(frozen=True)
class MetricDoc:
    name: str
    kind: str  # gauge, counter or histogram
    labels: tuple[str, ...]
    meaning: str


JOB_LABELS = ("namespace", "name")
JOB_METRICS = (
    MetricDoc("dtjob_job_step", "gauge", JOB_LABELS, "rank 0's latest step (status.step)"),
    MetricDoc("dtjob_job_total_steps", "gauge", JOB_LABELS, "the run's steps (status.progress.totalSteps)"),
    MetricDoc(
        "dtjob_job_eta_seconds",
        "gauge",
        JOB_LABELS,
        "seconds from the last sample of the step to status.eta (absent: not known)",
    ),
    MetricDoc(
        "dtjob_job_goodput_ratio",
        "gauge",
        JOB_LABELS,
        "kept-step time over wall time since the job started (status.goodput.ratio)",
    ),
    MetricDoc(
        "dtjob_job_tokens_per_second",
        "gauge",
        JOB_LABELS,
        f"rank 0's {METRIC_TOKENS_PER_SECOND} (status.progress.tokensPerSecond)",
    ),
    MetricDoc(
        "dtjob_job_model_flops_utilization",
        "gauge",
        JOB_LABELS,
        f"rank 0's {METRIC_MFU}, 0..1 (absent: unknown)",
    ),
    MetricDoc(
        "dtjob_job_restarts_total",
        "counter",
        (*JOB_LABELS, "cause"),
        "gang stops and restarts (in new pods or in place, planned or not) by cause",
    ),
    MetricDoc(
        "dtjob_job_recovery_seconds",
        "histogram",
        (*JOB_LABELS, "cause"),
        "downtime of each recovery: from the failure to the next gang's step moving",
    ),
    MetricDoc(
        "dtjob_job_steps_redone_total",
        "counter",
        JOB_LABELS,
        "steps past the newest checkpoint lost at a restart (status.recoveries[].stepsRedone)",
    ),
)
