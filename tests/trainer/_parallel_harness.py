"""Run wrapper cases in real multi-process gloo groups and compare with one process.

Spawning a process group costs seconds on this machine, so each `run_world(world_size, cases)`
spawns the group once and runs many cases in it. A case is a plain dict (picklable):

    name, model ("gpt" | "mlp"), config (see `wrap`), steps, batch (global batch size),
    optimizer ("adamw" | "sgd"), lr, measure ("memory": bytes held between steps and the peak
    during each; "release": whether the dropped model and optimizer are freed; or None),
    tie (mlp only: its two hidden layers share one weight, a parameter tied across blocks),
    trace_p2p (record the point-to-point calls of the training steps: result["p2p"]),
    overflow ((step, rank): that rank makes one of its gradients inf at that step)

config: strategy ("ddp" | "fsdp" | "pipeline" | "torch-fsdp2": torch's FSDP2 on fully_shard's
units, a yardstick for memory) and the wrappers' options (zero_stage, collective,
ddp_bucket_mb, ddp_first_bucket_mb, grad_compression, precision, zero3_prefetch, pipeline_stages,
microbatches, schedule), plus what the training loop does: grad_accum (no_sync micro-steps),
grad_clip (torch.nn.utils.clip_grad_norm_), activation_checkpointing. precision "fp16" trains
with a ShardedGradScaler; result["scales"] and result["optimizer_steps"] say, after each step,
its scale and how many steps the optimizer took.

Every rank trains in an ordinary user loop (forward, backward, clip, optimizer.step, zero_grad)
and returns, per case: the loss of each step, the model shards a checkpoint would write
(`TrainState.state_shards()`, so the final parameters are assembled from them) and any
measurement. `reference(case)` trains the same model on the same global batches in this process.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from dtjob.trainer.models import GPT, MLP, GPTConfig, MLPConfig
from dtjob.trainer.parallel.memory import PeakBytes, live_tensor_bytes
from dtjob.trainer.parallel.memory import plain_tensors as _plain_tensors
from tests.trainer._p2p_check import Recorder

GPT_SMALL = {"vocab": 32, "width": 16, "depth": 2, "heads": 2, "seq_len": 8}
MLP_SMALL = {"inputs": 12, "hidden": 24, "classes": 6, "depth": 4}


# Tiny random-init Hugging Face models, unmodified (dropout off, so one process is deterministic).
HF_VOCAB, HF_SEQ = 96, 16


def hf_model(kind: str) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "hf-gpt2":  # its head is tied to the token embedding
        config = transformers.GPT2Config(
            vocab_size=HF_VOCAB,
            n_positions=HF_SEQ,
            n_embd=32,
            n_layer=3,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=HF_SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def is_hf(case: dict[str, Any]) -> bool:
    return str(case.get("model", "")).startswith("hf-")


def build_model(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(case.get("seed", 0))
    if is_hf(case):
        return hf_model(case["model"])
    if case.get("model", "gpt") == "gpt":
        return GPT(GPTConfig(**{**GPT_SMALL, **case.get("model_kwargs", {})}))
    mlp = MLP(MLPConfig(**{**MLP_SMALL, **case.get("model_kwargs", {})}))
    if case.get("tie"):
        hidden = cast(nn.Sequential, mlp.layers[2])
        hidden[0].weight = cast(nn.Sequential, mlp.layers[1])[0].weight
    return mlp


def make_optimizer(
    case: dict[str, Any], named: list[tuple[str, nn.Parameter]], dims: dict[str, int]
) -> torch.optim.Optimizer:
    """As a user writes it: AdamW with no weight decay on biases and norms (chosen by name and the
    unwrapped parameter's dimensions), or SGD."""
    params = [p for _, p in named]
    if case.get("optimizer", "adamw") == "sgd":
        return torch.optim.SGD(params, lr=case.get("lr", 0.1), momentum=0.9)
    decay = [p for n, p in named if dims[n] >= 2]
    no_decay = [p for n, p in named if dims[n] < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    # eps=1e-5, not 1e-8: the attention's key bias has an analytically zero gradient, and with a
    # tiny eps Adam turns its rounding noise (which depends on summation order) into full-size
    # steps; even one process splitting its batch differently then drifts 1e-4 from itself.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=case.get("lr", 1e-2), eps=1e-5)


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor, case: dict[str, Any]) -> torch.Tensor:
    """The user's loss line: a Hugging Face model computes its own from labels."""
    if is_hf(case):
        loss: torch.Tensor = model(input_ids=x, labels=y).loss
        return loss
    return cross_entropy_loss(model(x), y)


def global_batch(case: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of global step `step`, the same whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    n = case.get("batch", 24)
    if is_hf(case):  # labels are the inputs: the model shifts them itself
        tokens = torch.randint(0, HF_VOCAB, (n, HF_SEQ), generator=g)
        return tokens, tokens
    if case.get("model", "gpt") == "gpt":
        cfg = {**GPT_SMALL, **case.get("model_kwargs", {})}
        tokens = torch.randint(0, cfg["vocab"], (n, cfg["seq_len"] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    cfg = {**MLP_SMALL, **case.get("model_kwargs", {})}
    return torch.randn(n, cfg["inputs"], generator=g), torch.randint(0, cfg["classes"], (n,), generator=g)


def reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch: losses per step and final parameters.

    Cached: many cases (every algorithm, accumulation, checkpointing) share one reference.
    """
    keys = ("model", "model_kwargs", "optimizer", "lr", "steps", "batch", "seed", "tie")
    key = repr(([case.get(k) for k in keys], case.get("config", {}).get("grad_clip")))
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(case)
    return _REFERENCES[key]


_REFERENCES: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}


def _train_reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(case)
    named = list(model.named_parameters())
    opt = make_optimizer(case, named, {n: p.dim() for n, p in named})
    clip = case.get("config", {}).get("grad_clip")
    losses = []
    for step in range(case.get("steps", 10)):
        x, y = global_batch(case, step)
        opt.zero_grad()
        loss = loss_of(model, x, y, case)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _shards_to_plain(state: Any, prefix: str = "") -> dict[str, tuple[Any, int, torch.Tensor]]:
    return {
        k: (s.global_shape, s.offset, s.local.detach().clone())
        for k, s in state.state_shards().items()
        if k.startswith(prefix)
    }


def assemble_flat(
    per_rank: list[dict[str, tuple[Any, int, torch.Tensor]]], what: str
) -> dict[str, torch.Tensor]:
    """Global flat tensors from every rank's shards; asserts each element is written exactly once."""
    tensors: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for key, (shape, offset, local) in shards.items():
            if key not in tensors:
                numel = 1
                for d in shape:
                    numel *= d
                tensors[key] = torch.zeros(numel, dtype=local.dtype)
                counts[key] = torch.zeros(numel, dtype=torch.int32)
            tensors[key][offset : offset + local.numel()] = local
            counts[key][offset : offset + local.numel()] += 1
    for key, c in counts.items():
        assert bool((c == 1).all()), f"{what}: {key} elements covered {c.min()}..{c.max()} times, not once"
    return tensors


def _wait_for(path: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.2)


def _load_checkpoint(state: Any, directory: str) -> None:
    files = sorted(f for f in os.listdir(directory) if f.startswith("rank"))
    assert files, f"no checkpoint files in {directory}"
    saved = [torch.load(os.path.join(directory, f)) for f in files]
    flat = assemble_flat([s["shards"] for s in saved], directory)

    def fetch(key: str, start: int, length: int) -> torch.Tensor:
        return flat[key][start : start + length].clone()

    state.load(fetch, saved[0]["extra"], {})


def wrap(model: nn.Module, config: dict[str, Any], hf: bool = False) -> nn.Module:
    """The case's wrapper around `model`, as a user would build it."""
    from dtjob.trainer.parallel import common, data_parallel, fully_shard, pipeline

    precision = None if config.get("precision", "fp32") == "fp32" else config["precision"]
    collective = config.get("collective", "auto")
    if config.get("activation_checkpointing"):
        common.apply_activation_checkpointing(common.blocks_in_order(model) or [])
    strategy = config.get("strategy", "ddp")
    if strategy == "ddp":
        return data_parallel(
            model,
            collective=collective,
            bucket_mb=config.get("ddp_bucket_mb", 25.0),
            first_bucket_mb=config.get("ddp_first_bucket_mb", 1.0),
            grad_compression=config.get("grad_compression", "none"),
            mixed_precision=precision,
        )
    if strategy == "torch-fsdp2":  # torch's own FSDP2, per-block units as fully_shard picks them
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        from dtjob.trainer.parallel.fsdp.module import auto_units

        reshard = config.get("zero_stage", 3) == 3
        for unit in auto_units(model):
            torch_fully_shard(unit, reshard_after_forward=reshard)
        return cast(nn.Module, torch_fully_shard(model, reshard_after_forward=reshard))
    if strategy == "fsdp":
        return fully_shard(
            model,
            zero_stage=config.get("zero_stage", 3),
            units=config.get("units"),
            collective=collective,
            mixed_precision=precision,
            prefetch=config.get("zero3_prefetch", True),
        )
    return pipeline(
        model,
        stages=config.get("pipeline_stages", 2),
        microbatches=config.get("microbatches", 4),
        schedule=config.get("schedule", "1f1b"),
        split=config.get("split"),
        collective=collective,
        mixed_precision=precision,
        loss_fn=None if hf else cross_entropy_loss,  # a Hugging Face output carries its .loss
    )


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    )


def _train_step(
    wrapped: Any,
    optimizer: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    case: dict[str, Any],
    scaler: Any = None,
    overflow: bool = False,
) -> float:
    """One step of the user's own loop; returns the global mean loss.

    scaler: a ShardedGradScaler (fp16). overflow: make one of this rank's gradients inf, as an fp16
    overflow on this rank alone would."""
    config = case.get("config", {})
    if config.get("strategy") == "pipeline":
        inputs = {"input_ids": x, "labels": y} if is_hf(case) else x
        scaling = {} if scaler is None else {"scaler": scaler}
        loss = float(wrapped.step(inputs, None if is_hf(case) else y, **scaling))
    else:
        parts = config.get("grad_accum", 1)
        local = torch.zeros((), dtype=torch.float64)
        chunks = list(zip(x.chunk(parts), y.chunk(parts), strict=True))
        for i, (xi, yi) in enumerate(chunks):
            with wrapped.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext():
                part = loss_of(wrapped, xi, yi, case) / parts
                (part if scaler is None else scaler.scale(part)).backward()
            local += part.detach().double()
        dist.all_reduce(local)
        loss = float(local) / dist.get_world_size()
    if overflow:
        grad = next(p.grad for p in wrapped.parameters() if p.grad is not None)
        grad.view(-1)[0] = float("inf")
    if config.get("grad_clip"):
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), config["grad_clip"])
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
    return loss


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    measure = case.get("measure")
    baseline = live_tensor_bytes() if measure in ("memory", "release") else 0
    tracker = PeakBytes()
    if measure == "release":
        gc.disable()  # what refcounting alone frees, without a collection in between
    try:
        with tracker if measure == "memory" else contextlib.nullcontext():
            result = _train_case(case, tracker, baseline, started)
        # _train_case has returned: the model, its wrapper and the optimizer are dropped.
        refs: dict[str, weakref.ref[Any]] = result.pop("refs", {})
        result["alive_without_gc"] = sorted(k for k, r in refs.items() if r() is not None)
    finally:
        gc.enable()
    if measure == "release":
        gc.collect()
        result["alive_after_gc"] = sorted(k for k, r in refs.items() if r() is not None)
        # What the result itself carries (the checkpoint shards' copies) is no leak.
        result["held_after_release"] = live_tensor_bytes() - baseline - _tensor_bytes(result)
    return result


def _tensor_bytes(value: Any) -> int:
    """Bytes of the distinct storages of the CPU tensors inside `value`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _plain_tensors(value)}
    return sum(storages.values())


def _train_case(case: dict[str, Any], tracker: PeakBytes, baseline: int, started: float) -> dict[str, Any]:
    from dtjob.trainer.train_state import TrainState

    model = build_model(case)
    refs: dict[str, weakref.ref[Any]] = {"module": weakref.ref(model)}
    refs["parameter"] = weakref.ref(next(model.parameters()))
    n_params = sum(p.numel() for p in model.parameters())
    dims = {n: p.dim() for n, p in model.named_parameters()}
    config = case.get("config", {})
    wrapped = wrap(model, config, hf=is_hf(case))
    del model
    optimizer = make_optimizer(case, list(wrapped.named_parameters()), dims)
    refs |= {"wrapper": weakref.ref(wrapped), "optimizer": weakref.ref(optimizer)}
    refs["optimizer's parameter"] = weakref.ref(optimizer.param_groups[0]["params"][0])
    # torch's FSDP2 (a comparison for memory) has no dtjob checkpoint shards.
    state = None if config.get("strategy") == "torch-fsdp2" else TrainState(wrapped, optimizer)
    if state is not None and case.get("load_from"):
        _wait_for(os.path.join(case["load_from"], "COMPLETE"))
        _load_checkpoint(state, case["load_from"])
    extras = [state.extra_state()] if state is not None and case.get("load_from") else []
    losses = []
    memory: list[int] = []
    tracked: list[int] = []
    peaks: list[int] = []
    replicas = getattr(wrapped, "data_parallel_size", dist.get_world_size())
    replica = getattr(wrapped, "data_parallel_rank", dist.get_rank())
    recorder = Recorder() if case.get("trace_p2p") else None  # see _p2p_check.py
    scaler = ShardedGradScaler("cpu") if config.get("precision") == "fp16" else None
    scales, optimizer_steps = [], []
    with recorder or contextlib.nullcontext():
        for step in range(case.get("start_step", 0), case.get("steps", 10)):
            x, y = global_batch(case, step)
            rows = x.shape[0] // replicas
            lo = replica * rows
            overflow = case.get("overflow") == (step, dist.get_rank())
            x, y = x[lo : lo + rows], y[lo : lo + rows]
            tracker.reset_peak()
            losses.append(_train_step(wrapped, optimizer, x, y, case, scaler, overflow))
            del x, y
            if scaler is not None:
                scales.append(scaler.get_scale())
                first = optimizer.param_groups[0]["params"][0]
                optimizer_steps.append(int(optimizer.state.get(first, {}).get("step", 0)))
            if case.get("measure") == "memory":
                memory.append(live_tensor_bytes() - baseline)
                tracked.append(tracker.current)
                peaks.append(tracker.peak)
    if state is not None and case.get("save_to"):
        os.makedirs(case["save_to"], exist_ok=True)
        saved = {"shards": _shards_to_plain(state), "extra": state.extra_state()}
        torch.save(saved, os.path.join(case["save_to"], f"rank{dist.get_rank()}.pt"))
        dist.barrier()
        if dist.get_rank() == 0:  # another world may be waiting to resume from it
            open(os.path.join(case["save_to"], "COMPLETE"), "w").close()
    if state is not None:
        extras.append(state.extra_state())
    result: dict[str, Any] = {
        "losses": losses,
        "shards": _shards_to_plain(state, "model.") if state is not None else {},
        "extras": extras,
        "n_params": n_params,
        "memory": memory,
        "tracked": tracked,  # PeakBytes: held after each step, and the peak during it
        "peak": peaks,
        "refs": refs if case.get("measure") == "release" else {},
        "seconds": time.perf_counter() - started,
    }
    from dtjob.trainer.parallel import DataParallel, FullyShardedModule

    if isinstance(wrapped, DataParallel):
        launches = (len(wrapped.buckets), wrapped.launched_in_backward, wrapped.launched_after_backward)
        result["ddp_launches"] = launches
    if isinstance(wrapped, FullyShardedModule):
        result["peak_gathered_units"] = (wrapped.peak_gathered_units, len(wrapped.units))
    if recorder is not None:
        result["p2p"] = recorder.calls
    if scaler is not None:
        result["scales"], result["optimizer_steps"] = scales, optimizer_steps
    peak = getattr(wrapped, "peak_live_microbatches", None)
    if peak is not None:
        result["peak_live_microbatches"] = peak
    return result


def _worker(
    rank: int,
    world_size: int,
    cases: list[dict[str, Any]],
    out_dir: str,
    run_case: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> None:
    torch.set_num_threads(1)
    run = run_case or _run_case
    # A file rendezvous: no port to pick, so concurrent worlds cannot collide.
    store = os.path.join(out_dir, "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case["name"]] = run(case)
        except Exception:
            results[case["name"]] = {"error": traceback.format_exc()}
            break  # the group may be out of step now; report what happened
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


class World:
    """A process group of `world_size` workers running `cases`, started without waiting.
    `run_case` (a module-level function: it is pickled by name) runs one case on each rank and
    returns its result; default: this module's training cases."""

    def __init__(
        self,
        world_size: int,
        cases: list[dict[str, Any]],
        run_case: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        names = [c["name"] for c in cases]
        assert len(set(names)) == len(names), "case names must be unique"
        self.world_size = world_size
        self._out_dir = tempfile.TemporaryDirectory(prefix=f"dtjob-world{world_size}-")
        # forkserver: one server process imports torch and this module once for the whole
        # session and forks every worker from it, instead of each spawned worker importing torch
        # again (seconds per process on two loaded cores). The server never runs torch ops, so
        # no thread pools exist to be broken by fork.
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed", "dtjob.trainer.parallel", "dtjob.trainer.train_state", __name__]
        )
        self._ctx = mp.start_processes(
            _worker,
            args=(world_size, cases, self._out_dir.name, run_case),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )

    def results(self, timeout: float = 600) -> list[dict[str, Any]]:
        """Wait for the workers; each rank's results by case name."""
        deadline = time.monotonic() + timeout
        try:
            while not self._ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    for p in self._ctx.processes:
                        p.kill()
                    raise TimeoutError(f"world of {self.world_size} did not finish within {timeout}s")
            out = self._out_dir.name
            return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(self.world_size)]
        finally:
            self._out_dir.cleanup()


def run_world(
    world_size: int,
    cases: list[dict[str, Any]],
    timeout: float = 600,
    run_case: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run every case in one gloo group of `world_size` processes; returns each rank's results."""
    return World(world_size, cases, run_case).results(timeout)


def assemble(rank_results: list[dict[str, Any]], case: str) -> dict[str, torch.Tensor]:
    """Global parameters from every rank's shards; asserts each element is written exactly once."""
    per_rank = [r[case]["shards"] for r in rank_results]
    flat = assemble_flat(per_rank, case)
    shapes = {k: shape for shards in per_rank for k, (shape, _, _) in shards.items()}
    return {k.removeprefix("model."): t.view(shapes[k]) for k, t in flat.items()}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_against_reference(
    rank_results: list[dict[str, Any]],
    case: dict[str, Any],
    tolerance: float = 1e-5,
    per_tensor: bool = True,
    param_tolerance: float | None = None,
) -> None:
    """Losses of every step and final parameters within `tolerance` (relative) of one process.

    per_tensor=False compares the whole parameter vector at once (for lossy options, where tiny
    zero-initialised biases have large relative but negligible absolute differences).
    """
    name = case["name"]
    for r, result in enumerate(rank_results):
        assert "error" not in result.get(name, {}), f"rank {r}: {result[name]['error']}"
    ref_losses, ref_params = reference(case)
    ref_losses = ref_losses[case.get("start_step", 0) :]
    losses = [r[name]["losses"] for r in rank_results]
    for r, rank_losses in enumerate(losses):
        assert rank_losses == losses[0], f"{name}: rank {r} losses {rank_losses} differ from rank 0's"
    assert len(losses[0]) == len(ref_losses) >= (10 if "start_step" not in case else 1)
    for step, (got, want) in enumerate(zip(losses[0], ref_losses, strict=True)):
        assert abs(got - want) <= tolerance * abs(want), f"{name}: step {step} loss {got} vs reference {want}"
    params = assemble(rank_results, name)
    assert set(params) == set(ref_params), f"{name}: parameter names differ"
    if not per_tensor:
        got_all = torch.cat([params[n].reshape(-1) for n in ref_params])
        want_all = torch.cat([p.reshape(-1) for p in ref_params.values()])
        diff = relative_difference(got_all, want_all)
        assert diff < tolerance, f"{name}: parameters relative difference {diff:.2e}"
        return
    for n, ref in ref_params.items():
        diff = relative_difference(params[n], ref)
        assert diff < (param_tolerance or tolerance), f"{name}: parameter {n} relative difference {diff:.2e}"
