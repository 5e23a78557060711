"""Test-only: let accelerate run FSDP and DeepSpeed on CPU ranks (gloo). Never in the product.

On GPUs none of this is needed; on our CPU-only CI accelerate 1.15 gets both wrong, silently:

- FSDP: an FSDP plugin becomes DistributedType.FSDP only for accelerator backends (MULTI_GPU,
  MULTI_XPU, ...). With `use_cpu=True` the state is MULTI_CPU, the plugin is dropped and the
  Trainer wraps the model in DDP. We switch the state to FSDP after AcceleratorState's own
  __init__, so accelerate and transformers take their FSDP paths (wrapping, sharded optimizer
  state, FSDP checkpoint layouts) on gloo.
- DeepSpeed: accelerate ignores DeepSpeed when `use_cpu=True`; with `use_cpu=False` and no
  accelerator it finds no backend, and DeepSpeed brings gloo up itself, but accelerate then
  believes it runs one process: every rank is "process zero" (each writes the same checkpoint
  files and sees the whole dataset). We report gloo / MULTI_CPU as the backend instead, so
  accelerate counts ranks from the process group DeepSpeed created.
"""

from __future__ import annotations

import functools
import os
from typing import Any


def install() -> None:
    """Patch accelerate once per process (before TrainingArguments are built)."""
    from accelerate import state
    from accelerate.utils import DistributedType

    # Plain "cpu", not "cpu:0": FSDP1 checks that its compute device equals device_id.
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    accelerator_state, partial_state = state.AcceleratorState, state.PartialState
    if getattr(accelerator_state, "_on_cpu_patched", False):
        return
    original_init = accelerator_state.__init__
    original_backend = partial_state._prepare_backend

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:  # noqa: N807
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            partial_state._shared_state["distributed_type"] = DistributedType.FSDP

    @functools.wraps(original_backend)
    def _prepare_backend(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        backend, distributed_type = original_backend(self, *args, **kwargs)
        if (
            backend is None
            and distributed_type == DistributedType.NO
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
            and "LOCAL_RANK" in os.environ
        ):
            return "gloo", DistributedType.MULTI_CPU
        return backend, distributed_type

    accelerator_state.__init__ = __init__
    partial_state._prepare_backend = _prepare_backend
    accelerator_state._on_cpu_patched = True
