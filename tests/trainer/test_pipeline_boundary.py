"""What crosses a pipeline stage boundary (pp/boundary.py, pp/split.py): pure functions, no group."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

from dtjob.trainer.parallel.pp import boundary
from dtjob.trainer.parallel.pp.split import spec_of, zeros_of


def test_nested_containers_and_constants_cross_and_are_rebuilt() -> None:
    hidden = torch.randn(2, 3, 4)
    bias = torch.randn(1, 4, 3, 3).transpose(-1, -2)  # a non-contiguous view, as T5's position bias
    args = (hidden, {"bias": bias, "masks": [torch.ones(2, 3), None]})
    kwargs = {"scale": 0.5, "causal": True, "dtype": torch.float32}
    crossing = boundary.capture("blocks.1", args, kwargs)
    assert [t is x for t, x in zip(crossing.tensors, [hidden, bias], strict=False)] == [True, True]
    assert len(crossing.tensors) == 3
    # The next stage's own call: stand-in zeros and other constants, the same structure.
    own = ((torch.zeros(2, 3, 4), {"bias": torch.zeros(1, 4, 3, 3), "masks": [torch.zeros(2, 3), None]}),)
    own_kwargs = {"scale": 1.0, "causal": False, "dtype": torch.float64}
    received = [t.contiguous().clone() for t in crossing.tensors]
    header = {"constants": crossing.constants, "layout": crossing.layout}
    new_args, new_kwargs = boundary.substitute("blocks.1", 1, own[0], own_kwargs, received, header)
    assert new_args[0] is received[0] and new_args[1]["bias"] is received[1]
    assert new_args[1]["masks"][1] is None
    assert new_kwargs == {"scale": 0.5, "causal": True, "dtype": torch.float32}


def test_a_model_output_does_not_cross_and_the_error_says_how_to_split() -> None:
    state = BaseModelOutput(last_hidden_state=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"BaseModelOutput \(argument 0\).*split=\["):
        boundary.capture("layers.2", (state,), {})


def test_a_constant_varying_between_microbatches_raises() -> None:
    first = boundary.capture("b", (torch.zeros(2),), {"length": 3})
    other = boundary.capture("b", (torch.zeros(2),), {"length": 4})
    boundary.check_constants("b", first, boundary.capture("b", (torch.ones(2),), {"length": 3}), 1)
    with pytest.raises(ValueError, match=r"micro-batch 1.*as a tensor"):
        boundary.check_constants("b", first, other, 1)


def test_a_call_shaped_otherwise_on_the_next_stage_raises() -> None:
    crossing = boundary.capture("b", (torch.zeros(2), torch.zeros(2)), {})
    header = {"constants": crossing.constants, "layout": crossing.layout}
    with pytest.raises(
        RuntimeError, match=r"shaped .* here but .* on stage 0; .* the same way on every stage"
    ):
        boundary.substitute("b", 1, ([torch.zeros(2), torch.zeros(2)],), {}, crossing.tensors, header)


def test_stand_ins_reproduce_dicts_and_model_outputs() -> None:
    out = BaseModelOutput(last_hidden_state=torch.randn(2, 3), hidden_states=(torch.randn(2, 3),))
    zeros = zeros_of(spec_of(out), torch.device("cpu"))
    assert isinstance(zeros, BaseModelOutput)
    assert zeros.last_hidden_state.shape == (2, 3) and zeros.hidden_states[0].shape == (2, 3)
    plain = zeros_of(spec_of({"a": torch.ones(1), "b": None}), torch.device("cpu"))
    assert isinstance(plain, dict) and plain["b"] is None and plain["a"].shape == (1,)


def test_a_hugging_face_cache_stays_on_each_stage() -> None:
    """Llama and GPT-2 pass a DynamicCache to every layer (use_cache=True by default): it holds
    each layer's own keys and values, so the next stage keeps its own."""
    from transformers import DynamicCache

    mine, theirs = DynamicCache(), DynamicCache()
    crossing = boundary.capture("layers.1", (torch.zeros(2),), {"cache": mine, "use_cache": True})
    header = {"constants": crossing.constants, "layout": crossing.layout}
    _, kwargs = boundary.substitute(
        "layers.1", 1, (torch.ones(2),), {"cache": theirs, "use_cache": False}, crossing.tensors, header
    )
    assert kwargs["cache"] is theirs and kwargs["use_cache"] is True
