"""One Hugging Face Trainer checkpoint, written the Trainer's way but not on its schedule.

`Trainer._save_checkpoint` (transformers 5) writes, all on the training thread: the model
(`save_model`: safetensors weights, config, generation config, tokenizer, training_args.bin),
the optimizer (`optimizer.pt`), scheduler, scaler, RNG states and `trainer_state.json`, then
rotates old checkpoints. `TrainerCheckpoint` produces the same files with the same names,
formats and serializers (HF's own functions where they can be called as they are), so HF's
resume and `from_pretrained` read them unchanged, in two parts:

- `write_small` (training thread, milliseconds): everything small, and everything that reads
  state other than weights: flops (a collective), the best-model path, RNG states, scheduler,
  scaler, the trainer state with its callbacks' state, training arguments, the tokenizer.
- `writers(path, tensors, threads, check)` (any thread): the model weights and the optimizer
  state, from the `tensors()` of this step or a host copy of them (snapshot.py), in the same
  formats but written straight to the disk (safetensors_save, torch_save); `check` runs before
  every chunk (a cancelled background save stops within one buffer).
- `deferrable()`: the storages only an optimizer step changes (parameters, optimizer state);
  the rest (module buffers such as BatchNorm's statistics) is copied before the next forward.

Rotation (save_total_limit) is not done here: the manager does it after the commit.
`unsupported()` names what this does not cover; those Trainers keep HF's own save. FSDP with a
sharded state dict is written by the Trainer itself, its DCP saves deferred (fsdp_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

# The save methods this replaces: a subclass that overrides one keeps the Trainer's own save.
REPLACED = (
    "save_model",
    "_save",
    "_save_optimizer_and_scheduler",
    "_save_rng_state",
    "_save_scaler",
)


def unsupported(trainer: Any) -> Optional[str]:  # noqa: PLR0911, PLR0912 - one reason per case
    """Why this Trainer's checkpoints must be written by the Trainer itself, or None."""
    from transformers import trainer as hf

    from jitckpt_entrypoint.hook import fsdp_checkpoint, output_dir_view

    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed writes its own checkpoint layout with collectives on the training group"
    fsdp = fsdp_checkpoint.sharded(trainer)  # written by the Trainer itself, DCP deferred
    if getattr(trainer, "is_fsdp_enabled", False) and not fsdp:
        return "FSDP FULL_STATE_DICT gathers the whole model on rank 0 (training-group collectives)"
    if hf.is_torch_xla_available() or hf.is_sagemaker_mp_enabled():
        return "XLA and SageMaker model parallelism save through their own APIs"
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        return "the model was sharded when it was loaded"
    if hf._is_peft_model(trainer.model) and not fsdp:
        return "PEFT adapters are small: their save is quick as it is"
    if getattr(trainer.model, "hf_quantizer", None) is not None:
        return "a quantized model is saved by its quantizer"
    device_map = getattr(trainer.model, "hf_device_map", None) or {}
    if {"cpu", "disk"} & set(device_map.values()):
        return "offloaded weights are saved from disk"
    if args.push_to_hub:
        return "push_to_hub uploads each checkpoint as the Trainer writes it"
    readers = output_dir_view.readers(trainer)
    if readers:
        return f"{readers[0]} has an on_save of its own (it may act on each checkpoint then)"
    if args.save_total_limit == 1 and args.metric_for_best_model is not None:
        return "save_total_limit=1 with a best model: the Trainer deletes checkpoints at the end"
    if getattr(args, "save_safetensors", True) is False:  # transformers 4: pytorch_model.bin
        return "save_safetensors=False: the Trainer writes and resumes pytorch_model.bin"
    optimizer = _inner(trainer.optimizer)
    if optimizer is not None and _steps_in_backward(optimizer):
        return f"{type(optimizer).__name__} updates the parameters during backward"
    for name in () if fsdp else REPLACED:
        if getattr(type(trainer), name) is not getattr(hf.Trainer, name):
            return f"{type(trainer).__name__} overrides {name}"
    return None


def _inner(optimizer: Any) -> Any:
    """The optimizer accelerate wraps (AcceleratedOptimizer.optimizer)."""
    return getattr(optimizer, "optimizer", optimizer)


def _steps_in_backward(optimizer: Any) -> bool:
    """LOMO, AdaLomo and HF's layer-wise optimizers update parameters inside backward."""
    name = type(optimizer).__name__
    return "Lomo" in name or "LOMO" in name or name == "LayerWiseDummyOptimizer"


def growth_bytes(trainer: Any) -> int:
    """Host memory training has yet to allocate when it starts on the CPU: gradients, and the
    optimizer state (Adam's two moments per trainable parameter) before the first step."""
    model = trainer.model
    trainable = [p for p in model.parameters() if p.requires_grad and p.device.type == "cpu"]
    total = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
    optimizer = trainer.optimizer
    if not trainer.args.save_only_model and not (optimizer is not None and optimizer.state):
        total += 2 * sum(p.numel() * p.element_size() for p in trainable)
    return int(total)


def snapshot_bytes(trainer: Any, *, whole_node: bool = False) -> int:
    """Host memory an async save's snapshot takes on this rank: the model's and the optimizer's
    tensors (before the first step, Adam's two moments per trainable parameter are counted).
    `whole_node`: a snapshot in RAM of a job of several nodes (TrainerCheckpoint's)."""
    from jitckpt_entrypoint.hook import fsdp_checkpoint

    if fsdp_checkpoint.sharded(trainer):
        return fsdp_checkpoint.snapshot_bytes(trainer)
    ckpt = TrainerCheckpoint(trainer, whole_node=whole_node)
    if not ckpt.should_save:
        return 0
    model = ckpt._model_to_save()
    total = _tensor_bytes(model.state_dict())
    if not trainer.args.save_only_model:
        optimizer = trainer.optimizer
        state = optimizer.state_dict()["state"] if optimizer is not None else {}
        if state:
            total += _tensor_bytes(state)
        else:
            trainable = sum(
                p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
            )
            total += 2 * trainable
    return total


def _tensor_bytes(tree: Any) -> int:
    from jitckpt_entrypoint.hook.snapshot import map_tree

    seen: dict[tuple[str, int], int] = {}

    def leaf(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()

    map_tree(tree, leaf)
    return sum(seen.values())


def rng_kept() -> bool:
    """The RNG states a survivors' save puts back (survivors.py) are all HF's save records:
    no XLA, NPU, HPU, MLU or MUSA device, whose states it does not keep."""
    from transformers import trainer as hf

    others = ("xla", "npu", "hpu", "mlu", "musa")
    return not any(getattr(hf, f"is_torch_{name}_available", lambda: False)() for name in others)


class TrainerCheckpoint:
    """What `trainer._save_checkpoint(model, trial)` writes at the current step; `alone`: what
    it writes on every rank together, written by this rank with no collective (a survivors'
    save, survivors.py: the other ranks are gone, their RNG files are copies of this rank's);
    `whole_node`: what every rank of this node loads to resume, the shared files written by
    the node's local rank 0 as by process 0 (a snapshot in RAM of a job of several nodes,
    memory_tier.py: each node's memory volume holds a whole copy; DDP ranks hold the same
    model, optimizer and scheduler state)."""

    def __init__(
        self, trainer: Any, trial: Any = None, *, alone: bool = False, whole_node: bool = False
    ) -> None:
        self.trainer = trainer
        self.trial = trial
        self.alone = alone
        self.whole_node = whole_node
        self.run_dir: str = trainer._get_output_dir(trial=trial)

    @property
    def should_save(self) -> bool:
        args = self.trainer.args
        return (
            self.alone
            or bool(args.should_save)
            or (self.whole_node and args.local_process_index == 0)
        )

    @property
    def _beside_process_zero(self) -> bool:
        """This rank writes the shared files for `alone` or `whole_node` though it is not
        process 0 (whatever HF's `should_save` says: transformers 5 writes the model on global
        rank 0 alone)."""
        others = self.alone or self.whole_node
        return others and self.should_save and self.trainer.args.process_index != 0

    def tensors(self) -> dict[str, Any]:
        """The model's and the optimizer's state dicts (live tensors): the big part."""
        trainer, out = self.trainer, {}
        if self.should_save:
            out["model"] = self._model_to_save().state_dict()
            if not trainer.args.save_only_model:
                out["optimizer"] = trainer.optimizer.state_dict()
        return out

    def deferrable(self) -> set[Any]:
        """Storage keys of what only the next optimizer step changes (snapshot.storage_key):
        the optimizer state, and the parameters unless the optimizer also changes them outside
        `step()` (schedule-free's `train()`, called before the next forward, swaps them)."""
        from jitckpt_entrypoint.hook.snapshot import storage_key

        keys: set[Any] = set()
        optimizer = _inner(self.trainer.optimizer)
        if optimizer is not None:
            for state in optimizer.state.values():
                keys.update(storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
        if optimizer is None or not callable(getattr(optimizer, "train", None)):
            keys.update(storage_key(p) for p in self._model_to_save().parameters())
        return keys

    def write_small(self, path: str) -> None:
        """Training thread: everything but the model weights and the optimizer state."""
        from transformers import trainer as hf

        trainer, args, state = self.trainer, self.trainer.args, self.trainer.state
        self._store_flos()
        os.makedirs(path, exist_ok=True)
        if (
            args.save_strategy
            in (hf.SaveStrategy.STEPS, hf.SaveStrategy.EPOCH, hf.SaveStrategy.BEST)
            and state.best_global_step
        ):
            # HF waits on a barrier for process 0's save, then checks the best step's directory
            # exists; this save's own directory is being written, older ones are committed.
            best = os.path.join(
                self.run_dir, f"{hf.PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
            )
            if state.best_global_step == state.global_step or os.path.exists(best):
                state.best_model_checkpoint = best
        if self.should_save:
            self._save_processing_class(path)
            torch.save(args, os.path.join(path, hf.TRAINING_ARGS_NAME))
        if not args.save_only_model:
            if self.should_save:
                with warnings.catch_warnings(record=True) as caught:
                    torch.save(
                        trainer.lr_scheduler.state_dict(), os.path.join(path, hf.SCHEDULER_NAME)
                    )
                hf.reissue_pt_warnings(caught)
            self._save_scaler_and_rng(path)
        if self.should_save:
            for cb in [*trainer.callback_handler.callbacks, trainer.control]:
                if isinstance(cb, hf.ExportableState):
                    name = cb.__class__.__name__
                    if isinstance(state.stateful_callbacks[name], list):
                        state.stateful_callbacks[name].append(cb.state())
                    else:
                        state.stateful_callbacks[name] = cb.state()
            state.save_to_json(os.path.join(path, hf.TRAINER_STATE_NAME))

    def writers(
        self, path: str, tensors: dict[str, Any], threads: int, check: Any = None
    ) -> list[Callable[[], object]]:
        """The big files, one writer each, from `tensors` (this step's, or a copy of them),
        each written straight to the disk by up to `threads` threads."""
        from transformers import trainer as hf

        from jitckpt_entrypoint.hook import torch_save

        out: list[Callable[[], object]] = []
        if "model" in tensors:
            out.append(lambda: self._save_model(path, tensors["model"], threads, check))
        if "optimizer" in tensors:
            target = os.path.join(path, hf.OPTIMIZER_NAME)
            out.append(lambda: torch_save.save(tensors["optimizer"], target, threads, check))
        return out

    def _store_flos(self) -> None:
        trainer = self.trainer
        if self.alone:  # store_flos without its collective: DDP ranks count alike
            trainer.state.total_flos += trainer.current_flos * trainer.args.world_size
            trainer.current_flos = 0
        elif trainer.hp_search_backend is None and self.trial is None:
            trainer.store_flos()  # a collective in distributed training: every rank, in step

    def _save_scaler(self, path: str) -> None:
        """The gradient scaler's state (process 0's file), from this rank; DDP ranks' agree
        (their gradients are all-reduced before the scaler looks for infs)."""
        from transformers import trainer as hf

        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is not None:
            torch.save(scaler.state_dict(), os.path.join(path, hf.SCALER_NAME))

    def _save_scaler_and_rng(self, path: str) -> None:
        if self.alone:
            self._save_alone(path)
            return
        if self.should_save and not self.trainer.args.should_save:
            self._save_scaler(path)  # HF's writes where should_save only
        self.trainer._save_scaler(path)
        self.trainer._save_rng_state(path)

    def _save_alone(self, path: str) -> None:
        """The scaler (process 0's file) and every rank's RNG file, from this rank."""
        trainer = self.trainer
        self._save_scaler(path)
        trainer._save_rng_state(path)
        world, own = trainer.args.world_size, trainer.args.process_index
        if world <= 1:
            return
        mine = os.path.join(path, f"rng_state_{own}.pth")
        others = [r for r in range(world) if r != own]
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            for rank in others:
                shutil.copyfile(mine, os.path.join(path, f"rng_state_{rank}.pth"))
            return
        # One CUDA state per visible device: rank r draws on device local_rank(r), so its copy
        # holds this rank's own device's state there.
        states = torch.load(mine, weights_only=False)  # this rank's own file
        cuda = states.get("cuda")
        local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        for rank in others:
            copy, device = dict(states), rank % local_world
            if isinstance(cuda, list) and device < len(cuda):
                copy["cuda"] = [*cuda]
                copy["cuda"][device] = cuda[torch.cuda.current_device()]
            torch.save(copy, os.path.join(path, f"rng_state_{rank}.pth"))

    # -- Trainer._save, from a given state dict --

    def _model_to_save(self) -> Any:
        from transformers import modeling_utils

        model = self.trainer.model
        supported = modeling_utils.PreTrainedModel
        if isinstance(model, supported):
            return modeling_utils.unwrap_model(model)  # what save_pretrained saves
        unwrapped = self.trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
        return unwrapped if isinstance(unwrapped, supported) else model

    def _save_model(self, path: str, state_dict: dict[str, Any], threads: int, check: Any) -> None:
        from transformers import modeling_utils
        from transformers import trainer as hf

        from jitckpt_entrypoint.hook import safetensors_save

        model = self._model_to_save()
        if isinstance(model, modeling_utils.PreTrainedModel):
            with _direct_safetensors(threads, check), self._any_rank(model):
                model.save_pretrained(path, state_dict=state_dict, is_main_process=True)
        else:
            target = os.path.join(path, hf.SAFE_WEIGHTS_NAME)
            safetensors_save.save_file(state_dict, target, {"format": "pt"}, threads, check)

    @contextlib.contextmanager
    def _any_rank(self, model: Any) -> Iterator[None]:
        """`alone`, `whole_node`: save_pretrained writes on this rank, though not rank 0
        (transformers 5 writes only on rank 0 of the default process group:
        `should_save_on_this_rank`)."""
        if not self._beside_process_zero:
            yield
            return
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        try:
            yield
        finally:
            del model.should_save_on_this_rank

    def _save_processing_class(self, path: str) -> None:
        trainer = self.trainer
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(path)
        elif getattr(trainer.data_collator, "tokenizer", None) is not None:
            trainer.data_collator.tokenizer.save_pretrained(path)


_direct = threading.local()


@contextlib.contextmanager
def _direct_safetensors(threads: int, check: Any = None) -> Iterator[None]:
    """`save_pretrained` on this thread writes its safetensors files with safetensors_save.

    transformers calls the `safe_save_file` of its modeling_utils module; that name is replaced
    once, for good, by a function that sends this thread's calls made in here to
    safetensors_save and every other call to safetensors itself (no patch to undo, so saves on
    other threads never see a half-restored module).
    """
    from transformers import modeling_utils

    from jitckpt_entrypoint.hook import safetensors_save

    if not getattr(modeling_utils.safe_save_file, "_jitckpt", False):
        original = modeling_utils.safe_save_file

        def safe_save_file(tensors: Any, filename: Any, metadata: Any = None) -> None:
            n = getattr(_direct, "threads", 0)
            if n:
                safetensors_save.save_file(tensors, str(filename), metadata, n, _direct.check)
            else:
                original(tensors, filename, metadata=metadata)

        safe_save_file._jitckpt = True  # type: ignore[attr-defined]
        modeling_utils.safe_save_file = safe_save_file
    _direct.threads, _direct.check = threads, check
    try:
        yield
    finally:
        _direct.threads, _direct.check = 0, None
