"""Models and per-rank checks for test_pipeline_models.py: pipelines of models no other test uses.

`run(world, checks)` spawns one gloo group of `world` processes and runs the named checks of
CHECKS in it, in order (spawning costs seconds here); each returns a picklable dict per rank. The
single-process references run in the test's own process (`t5_reference`, `moe_reference`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtjob.trainer.parallel import pipeline
from tests.trainer._parallel_harness import run_world

STEPS = 3
TIMEOUT_S = 240  # a hang fails the test instead of blocking it
T5_VOCAB, T5_SEQ, T5_BATCH = 64, 12, 8
MOE_IN, MOE_WIDTH, MOE_CLASSES, MOE_BATCH = 6, 16, 5, 16


# -- the models ----------------------------------------------------------------------------------
def t5() -> nn.Module:
    """A tiny random T5: embeddings tied to the head, relative position bias (whose tensor crosses
    a decoder-block boundary as a non-contiguous view). Cut at the last decoder block: every
    decoder block reads the encoder's output from the stack's local variable, so a cut before an
    earlier block leaves a connection around it (which the pipeline refuses)."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.T5Config(
        vocab_size=T5_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def t5_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(2, T5_VOCAB, (T5_BATCH, T5_SEQ), generator=g)
    return {"input_ids": tokens, "labels": tokens.flip(1)}


class TopOneMoE(nn.Module):
    """Top-1 mixture of experts: each token goes to its gate's best expert, scaled by that
    expert's gate probability. An expert no token chose is not run (no gradient at all), as in
    Hugging Face's MoE layers. Expert 3's gate bias keeps every token away from it; expert 2's
    makes it rare."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        with torch.no_grad():
            self.gate.bias[3] = -1e4
            # Rarely chosen: at step 0, by one token of block 0 in the first half of the batch
            # (replica 0's with 2 replicas), none of the second's: the replicas must agree.
            self.gate.bias[2] = -0.5

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = self.gate(h).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero(as_tuple=True)[0]
            if idx.numel():
                out = out.index_add(0, idx, expert(h[idx]) * weight[idx, None])
        return h + out


class SparseNet(nn.Module):
    """A frozen layer (stage 0), an MoE per stage, and a layer the forward never calls (stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(MOE_IN, MOE_WIDTH)
        self.frozen = nn.Linear(MOE_WIDTH, MOE_WIDTH)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([TopOneMoE(MOE_WIDTH), TopOneMoE(MOE_WIDTH)])
        self.unused = nn.Linear(MOE_WIDTH, MOE_WIDTH)
        self.head = nn.Linear(MOE_WIDTH, MOE_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.embed(x)).tanh()
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def sparse_net() -> nn.Module:
    torch.manual_seed(0)
    return SparseNet()


def moe_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randn(MOE_BATCH, MOE_IN, generator=g) * 2
    return x, torch.randint(0, MOE_CLASSES, (MOE_BATCH,), generator=g)


def adamw(params: Any) -> torch.optim.Optimizer:
    # weight decay: a parameter given a zero gradient instead of None would still move.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


# -- single-process references -------------------------------------------------------------------
def t5_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = t5()
    opt = adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = model(**t5_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def moe_reference(evaluate: bool = False) -> dict[str, Any]:
    model = sparse_net()
    opt = adamw(model.parameters())
    losses, grads_none, evals, eval_logits = [], [], [], []
    for step in range(STEPS):
        x, y = moe_batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads_none.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if evaluate:
            xe, ye = moe_batch(100 + step)
            with torch.no_grad():
                logits = model(xe)
            evals.append(float(F.cross_entropy(logits, ye)))
            eval_logits.append(logits)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "weights": weights,
        "grads_none": grads_none,
        "evals": evals,
        "logits": eval_logits,
    }


# -- per-rank checks -----------------------------------------------------------------------------
def check_t5(rank: int, world: int) -> dict[str, Any]:
    pipe = pipeline(t5(), stages=2, microbatches=2, split=["decoder.block.1"])
    opt = adamw(pipe.parameters())
    losses = []
    for step in range(STEPS):
        losses.append(pipe.step(t5_batch(step)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": pipe.full_state_dict()}


def _train_sparse(pipe: Any, evaluate: bool) -> dict[str, Any]:
    opt = adamw(pipe.parameters())
    share = MOE_BATCH // pipe.replicas  # each replica's slice of the global batch
    replica_rows = slice(pipe.replica * share, (pipe.replica + 1) * share)
    losses, grads_none, evals, logits, no_grad_errors = [], [], [], [], []
    for step in range(STEPS):
        x, y = moe_batch(step)
        losses.append(pipe.step(x[replica_rows], y[replica_rows]))
        grads_none.append(sorted(n for n, p in pipe.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        if evaluate:
            xe, ye = moe_batch(100 + step)
            loss, out = pipe.eval_step(xe[replica_rows], ye[replica_rows])
            evals.append(loss)
            logits.append(out)
            # Evaluation touched no gradient: every one is still None after zero_grad().
            assert all(p.grad is None for p in pipe.parameters())
            with torch.no_grad():  # a training step without autograd raises at once, everywhere
                try:
                    pipe.step(x[replica_rows], y[replica_rows])
                    no_grad_errors.append("")
                except RuntimeError as err:
                    no_grad_errors.append(str(err))
    return {
        "losses": losses,
        "grads_none": grads_none,
        "owned": sorted(n for n, _ in pipe.named_parameters()),
        "weights": pipe.full_state_dict(),
        "evals": evals,
        "logits": logits,
        "no_grad_errors": no_grad_errors,
    }


def check_sparse(rank: int, world: int) -> dict[str, Any]:
    pipe = pipeline(sparse_net(), stages=2, microbatches=2, split=["blocks.1"])
    return _train_sparse(pipe, evaluate=False)


def check_eval(rank: int, world: int) -> dict[str, Any]:
    pipe = pipeline(sparse_net(), stages=2, microbatches=2, split=["blocks.1"], schedule="gpipe")
    return _train_sparse(pipe, evaluate=True)


class Wrapped(nn.Module):
    """A block that takes and returns a Hugging Face ModelOutput, as some models' layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(MOE_WIDTH, MOE_WIDTH)

    def forward(self, state: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.linear(state.last_hidden_state).tanh())


class OutputChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(MOE_IN, MOE_WIDTH)
        self.layers = nn.ModuleList(Wrapped() for _ in range(4))
        self.head = nn.Linear(MOE_WIDTH, MOE_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.modeling_outputs import BaseModelOutput

        state = BaseModelOutput(last_hidden_state=self.embed(x))
        for layer in self.layers:
            state = layer(state)
        return self.head(state.last_hidden_state)


def check_auto_split_model_output(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    pipe = pipeline(OutputChain(), stages=2, microbatches=2)
    x, y = moe_batch(0)
    try:
        pipe.step(x, y)
    except Exception as err:  # the test reads it
        return {"raised": f"{type(err).__name__}: {err}"}
    return {"raised": None}


CHECKS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "t5": check_t5,
    "sparse": check_sparse,
    "eval": check_eval,
    "auto_split": check_auto_split_model_output,
}


# -- the process group ---------------------------------------------------------------------------
def _run_check(case: dict[str, Any]) -> dict[str, Any]:
    return CHECKS[case["name"]](dist.get_rank(), dist.get_world_size())


@functools.cache
def run(world: int, checks: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each rank's results of `checks`, run in order in one group of `world` processes (a check
    that raised: {"error": its traceback}, and the later ones not run)."""
    return run_world(world, [{"name": name} for name in checks], timeout=TIMEOUT_S, run_case=_run_check)
