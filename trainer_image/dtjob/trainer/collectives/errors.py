"""The exceptions dtjob's collectives raise for invalid input, shaped like torch's.

torch raises different classes for the same misuse depending on the backend: gloo's C++ checks
surface as RuntimeError, NCCL's as ValueError (sizes) or TypeError (dtypes). Code written
against either catches what its backend raises, so each error here is both at once: an
`InvalidArgument` is a ValueError and a RuntimeError, an `InvalidType` a TypeError and a
RuntimeError. Where torch's Python layer raises one class on every backend (a tensor that is not
a torch.Tensor: TypeError; complex MAX: ValueError) that class is among the bases too.
"""

from __future__ import annotations


class InvalidArgument(ValueError, RuntimeError):
    """A wrong value: sizes that do not match the world size, a rank outside the group, an op that
    the dtype has no meaning for. gloo raises RuntimeError for these, NCCL ValueError."""


class InvalidType(TypeError, RuntimeError):
    """A wrong or unsupported dtype: output and input dtypes differ, or nobody can reduce it.
    gloo raises RuntimeError for these, NCCL TypeError."""


__all__ = ["InvalidArgument", "InvalidType"]
