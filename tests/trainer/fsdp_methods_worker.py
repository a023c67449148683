"""The checks of test_fsdp_methods.py, run by every rank of a 2-process gloo group.

The user's own methods on a fully_shard'ed Hugging Face model (generate(), get_encoder(), the
embeddings, a submodule's eval forward) and unshard()/reshard(), compared with one process that
holds the unwrapped model and trains it identically on the whole global batch. Models: a GPT-2 and
a T5 of shapes no other test uses (T5: tied embeddings, relative position bias). Each check
returns "ok" or its traceback; the ranks run the same checks in the same order.
"""

from __future__ import annotations

import traceback
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtjob.trainer.parallel import fully_shard
from dtjob.trainer.parallel.fsdp.module import FullyShardedModule

WORLD = 2
VOCAB = 50
GLOBAL_BATCH = 4  # two samples per rank
STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=24,
        n_layer=2,
        n_head=3,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def t5() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        tie_word_embeddings=True,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.0)


def batch(step: int, model: str) -> dict[str, torch.Tensor]:
    """Global step `step`'s batch (tokens 1.., so no padding); labels have equal lengths, so the
    mean of the ranks' mean losses is the global batch's."""
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, 12), generator=g)
    labels = ids if model == "gpt2" else torch.randint(1, VOCAB, (GLOBAL_BATCH, 6), generator=g)
    return {"input_ids": ids, "labels": labels}


def mine(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    per = GLOBAL_BATCH // WORLD
    r = dist.get_rank()
    return {k: v[r * per : (r + 1) * per] for k, v in full.items()}


def global_loss(local: torch.Tensor) -> float:
    total = local.detach().clone()
    dist.all_reduce(total)
    return float(total) / WORLD


def train_step(model: Any, opt: torch.optim.Optimizer, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    opt.zero_grad()
    loss: torch.Tensor = model(**inputs).loss
    loss.backward()
    opt.step()
    return loss


def prompt() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))


def greedy(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.scores)


def gathered_bytes(model: FullyShardedModule) -> int:
    """Bytes of gathered (full) parameters the units hold; 0 between steps at ZeRO-3."""
    return sum(u.full.untyped_storage().nbytes() for u in model.units)


def same_generation(model: Any, ref: nn.Module) -> None:
    ids = prompt()
    before = gathered_bytes(model)
    tokens, scores = greedy(model, ids)
    want_tokens, want_scores = greedy(ref, ids)
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    torch.testing.assert_close(scores, want_scores, **TOL)
    assert gathered_bytes(model) == before, (gathered_bytes(model), before)  # back to the shards


def check_gpt2_generate(stage: int) -> None:
    """generate() equals the unwrapped model's before and after training steps (a generate()
    between every step), the steps' losses equal one process's, and so do the embeddings', the
    head's and a block's eval forwards."""
    ref, model = gpt2(), fully_shard(gpt2(), zero_stage=stage)
    if stage == 3:
        assert gathered_bytes(model) == 0
    ref_opt, opt = optimizer(ref.parameters()), optimizer(model.parameters())
    same_generation(model, ref)
    # Taken before training, used after it.
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    block = model.transformer.h[1]
    for step in range(STEPS):
        full = batch(step, "gpt2")
        want = float(train_step(ref, ref_opt, full))
        got = global_loss(train_step(model, opt, mine(full)))
        torch.testing.assert_close(got, want, **TOL)
        same_generation(model, ref)
    ids = prompt()
    hidden = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(embeddings(ids), ref.get_input_embeddings()(ids), **TOL)
        torch.testing.assert_close(head(hidden), ref.get_output_embeddings()(hidden), **TOL)
        torch.testing.assert_close(block(hidden)[0], ref.transformer.h[1](hidden)[0], **TOL)
        # A unit reached around the wrapper gathers itself too (its hooks).
        first = model.module.transformer.h[0](hidden)[0]
        torch.testing.assert_close(first, ref.transformer.h[0](hidden)[0], **TOL)
        # A module inside a unit, reached through the wrapper and called on its own.
        attention = model.transformer.h[0].attn
        torch.testing.assert_close(attention(hidden)[0], ref.transformer.h[0].attn(hidden)[0], **TOL)
    if stage == 3:
        assert gathered_bytes(model) == 0  # also the next unit, which the first one prefetched
    check_parameter_reads(model, ref, stage)
    try:
        embeddings(ids).sum().backward()
    except RuntimeError as err:
        assert "fully_shard" in str(err) and "torch.no_grad()" in str(err), err
    else:
        raise AssertionError("training through get_input_embeddings() outside the wrapper's forward ran")
    # Training goes on unchanged after all that.
    full = batch(STEPS, "gpt2")
    torch.testing.assert_close(
        global_loss(train_step(model, opt, mine(full))), float(train_step(ref, ref_opt, full)), **TOL
    )


def _loss_method(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = self(input_ids=input_ids, labels=labels).loss
    return loss


def check_training_through_a_method() -> None:
    """A method of the user's that runs the forward with gradients (reached through the wrapper)
    trains as model(...) does: its step stays open for the backward, which reduces."""
    ref, model = gpt2(), fully_shard(gpt2(), zero_stage=3)
    model.module.loss_of = types.MethodType(_loss_method, model.module)
    ref_opt, opt = optimizer(ref.parameters()), optimizer(model.parameters())
    for step in range(2):
        full = batch(step, "gpt2")
        want = float(train_step(ref, ref_opt, full))
        opt.zero_grad()
        loss = model.loss_of(**mine(full))
        loss.backward()
        opt.step()
        torch.testing.assert_close(global_loss(loss), want, **TOL)
    assert gathered_bytes(model) == 0


def _block_sum(self: nn.Module) -> float:
    return float(self.transformer.h[0].mlp.c_fc.weight.sum())


def check_parameter_reads(model: Any, ref: nn.Module, stage: int) -> None:
    """A method that reads parameters outside any forward: shapes are the full ones at every
    stage; values too at ZeRO-1/2, while at ZeRO-3 an ungathered unit's parameters have no data
    (meta), so reading them raises instead of returning this rank's shard or crashing."""
    assert model.num_parameters() == ref.num_parameters()
    model.module.block_sum = types.MethodType(_block_sum, model.module)
    want = _block_sum(ref)
    if stage < 3:
        torch.testing.assert_close(model.block_sum(), want, **TOL)
        return
    try:
        got = model.block_sum()
    except (RuntimeError, NotImplementedError) as err:
        assert "meta" in str(err), err
    else:
        raise AssertionError(f"ZeRO-3 read an ungathered unit's parameter: {got} (full: {want})")
    assert gathered_bytes(model) == 0


def _registered(model: FullyShardedModule) -> dict[str, torch.Tensor]:
    return dict(model.module.named_parameters())


def _check_unsharded(model: FullyShardedModule, ref: nn.Module, stage: int) -> None:
    want = dict(ref.named_parameters())
    got = _registered(model)
    assert got.keys() == want.keys()
    for name, p in got.items():
        torch.testing.assert_close(p.detach(), want[name].detach(), **TOL, msg=name)
    ids = prompt()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)
        torch.testing.assert_close(model.module(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)
    assert all(p.shape == want[n].shape for n, p in _registered(model).items())  # still full
    if stage == 3:  # every unit still gathered after those forwards
        assert gathered_bytes(model) == sum(u.padded * u.full.element_size() for u in model.units)
    try:
        model(input_ids=ids, labels=ids)
    except RuntimeError as err:
        assert "reshard()" in str(err), err
    else:
        raise AssertionError("a forward with gradients ran while unsharded")


def check_unshard_round_trip(stage: int) -> None:
    """unshard() (twice: the second changes nothing) and summon_full_params(): the wrapped module
    holds the full trained parameters, no-grad forwards keep them, a forward with gradients is
    refused; reshard() (twice): the shards again, memory freed, and the next training step equals
    one process's."""
    ref, model = gpt2(), fully_shard(gpt2(), zero_stage=stage)
    ref_opt, opt = optimizer(ref.parameters()), optimizer(model.parameters())
    for step in range(2):
        full = batch(step, "gpt2")
        train_step(ref, ref_opt, full)
        train_step(model, opt, mine(full))
    sharded = gathered_bytes(model)
    for variant in ("unshard", "summon_full_params"):
        if variant == "unshard":
            assert model.unshard() is None
            model.unshard()
            _check_unsharded(model, ref, stage)
            model.reshard()
            model.reshard()
        else:
            with model.summon_full_params():
                _check_unsharded(model, ref, stage)
        assert all(isinstance(p, DTensor) for p in _registered(model).values()), variant
        assert gathered_bytes(model) == sharded, variant
    full = batch(2, "gpt2")
    torch.testing.assert_close(
        global_loss(train_step(model, opt, mine(full))), float(train_step(ref, ref_opt, full)), **TOL
    )


def check_t5_zero3() -> None:
    """T5 (tied embeddings, relative position bias) at ZeRO-3: the training losses equal one
    process's on the global batch; get_encoder(), taken before training, gives the trained
    encoder's hidden states; get_decoder() and generate() too."""
    ref, model = t5(), fully_shard(t5(), zero_stage=3)
    ref_opt, opt = optimizer(ref.parameters()), optimizer(model.parameters())
    encoder, decoder = model.get_encoder(), model.get_decoder()
    for step in range(STEPS):
        full = batch(step, "t5")
        want = float(train_step(ref, ref_opt, full))
        got = global_loss(train_step(model, opt, mine(full)))
        torch.testing.assert_close(got, want, **TOL)
    ids = batch(0, "t5")["input_ids"]
    with torch.no_grad():
        hidden = encoder(input_ids=ids).last_hidden_state
        want_hidden = ref.get_encoder()(input_ids=ids).last_hidden_state
        torch.testing.assert_close(hidden, want_hidden, **TOL)
        start = torch.zeros(ids.shape[0], 3, dtype=torch.long)
        torch.testing.assert_close(
            decoder(input_ids=start, encoder_hidden_states=hidden).last_hidden_state,
            ref.get_decoder()(input_ids=start, encoder_hidden_states=want_hidden).last_hidden_state,
            **TOL,
        )
    assert gathered_bytes(model) == 0
    same_generation(model, ref)


CHECKS: dict[str, Callable[[], None]] = {
    **{f"gpt2-generate-zero{s}": (lambda s=s: check_gpt2_generate(s)) for s in (1, 2, 3)},
    **{f"unshard-zero{s}": (lambda s=s: check_unshard_round_trip(s)) for s in (1, 2, 3)},
    "t5-zero3": check_t5_zero3,
    "train-through-method": check_training_through_a_method,
}


def run_checks() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, check in CHECKS.items():
        try:
            check()
            out[name] = "ok"
        except BaseException:
            out[name] = traceback.format_exc()
    return out
