"""Built-in plans (`plan="auto"`) for Hugging Face GPT-2 and Llama and for dtjob's own GPT
(`--model gpt`, models/gpt.py), and the attention modules' head counts made local after their
projections are split."""

from __future__ import annotations

from torch import nn

GPT2_PLAN = {
    "transformer.wte": "vocab",
    "lm_head": "vocab",  # tied to wte: one shard serves both
    "transformer.h.*.attn.c_attn": "colwise_qkv",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}

LLAMA_PLAN = {
    "model.embed_tokens": "vocab",
    "lm_head": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}

# dtjob's GPT (models/gpt.py): its attention takes the heads from qkv's local width; the position
# embedding and the norms stay replicated.
DTJOB_GPT_PLAN = {
    "embed.tokens": "vocab",
    "blocks.*.attn.qkv": "colwise_qkv",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "head.out": "vocab",
}

_PLANS = {"gpt2": GPT2_PLAN, "llama": LLAMA_PLAN, "dtjob-gpt": DTJOB_GPT_PLAN}


def has_auto_plan(model: nn.Module) -> bool:
    """Whether plan="auto" knows the model's family."""
    return getattr(getattr(model, "config", None), "model_type", None) in _PLANS


def auto_plan(model: nn.Module) -> dict[str, str]:
    """The built-in plan for the model's family (its config.model_type)."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in _PLANS:
        raise ValueError(
            f"tensor_parallel: plan='auto' knows Hugging Face gpt2 and llama models and dtjob's GPT, not "
            f"{type(model).__name__} (model_type {family!r}); pass plan={{module pattern: 'colwise' | "
            "'rowwise' | 'vocab'}}"
        )
    return dict(_PLANS[family])


def check_heads(model: nn.Module, size: int) -> None:
    """Hugging Face configs: the head counts must divide by the TP size (each rank takes whole heads)."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads", "n_head", "heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(
                f"tensor_parallel: config.{field} = {heads} is not divisible by the TP size {size}"
            )
    for field in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        p = getattr(config, field, 0.0)
        if isinstance(p, float) and p > 0:
            raise ValueError(
                f"tensor_parallel: config.{field} = {p}: dropout is not supported (its random masks are not "
                "coordinated across the TP ranks); set it to 0.0"
            )


def localize_heads(model: nn.Module, size: int) -> None:
    """GPT-2's attention splits c_attn's output by `split_size` (the width): make it, the head count
    and the width this rank's. Llama's attention reshapes with -1 heads and needs nothing."""
    for module in model.modules():
        gpt2_attention = type(module).__name__.startswith("GPT2") and hasattr(module, "c_attn")
        if gpt2_attention and hasattr(module, "split_size"):
            for attr in ("split_size", "embed_dim", "num_heads"):
                setattr(module, attr, getattr(module, attr) // size)
