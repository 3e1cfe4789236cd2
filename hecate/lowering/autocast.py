"""What a fused op does under ``torch.autocast``: run in the dtype eager runs the code it replaced in.

The chains the ops replace start with matmuls or convolutions, which autocast runs in its lower dtype
(``torch.get_autocast_dtype``, bf16 or fp16), so eager's result has that dtype. A fused op is opaque to
autocast, so each op declares which of its arguments autocast casts: those, when fp32 and on the
autocast's device (float64 is left alone, as autocast leaves it), become the autocast dtype, and the op
then runs with autocast off. The other arguments keep their dtype: the recurrent state and the gates stay
fp32 (the ops hold the state in fp32 inside whatever the input dtype).
"""

from __future__ import annotations

from typing import Sequence

import torch

_LIBRARY = torch.library.Library("hecate", "IMPL")   # kept alive: the registrations live as long as it does
DEVICES = ("cpu", "cuda")


def _cast(value, device: str, dtype: torch.dtype):
    """``value`` (a tensor or a list of them) cast as autocast casts: fp32/fp16/bf16 tensors on ``device``."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, device, dtype) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == device \
            and value.dtype != torch.float64:
        return value.to(dtype)
    return value


def register_autocast(op: torch._library.custom_ops.CustomOpDef, cast: Sequence[str]) -> None:
    """Under autocast on CPU and CUDA, call ``op`` with its arguments named in ``cast`` in the autocast dtype."""
    overload = op._opoverload
    names = [argument.name for argument in overload._schema.arguments]
    unknown = sorted(set(cast) - set(names))
    if unknown:
        raise ValueError(f"register_autocast: {overload} has no arguments {unknown}; its arguments are {names}")
    positions = {names.index(name) for name in cast}
    for device in DEVICES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, device=device, excluded=excluded, **kwargs):
            dtype = torch.get_autocast_dtype(device)
            args = [_cast(a, device, dtype) if i in positions else a for i, a in enumerate(args)]
            kwargs = {n: _cast(a, device, dtype) if n in cast else a for n, a in kwargs.items()}
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return overload(*args, **kwargs)

        _LIBRARY.impl(op._name, kernel, key, with_keyset=True)
