"""A tiny, deterministic Hugging Face training script; it knows nothing about jitckpt.

Builds a 2-layer Llama from a config (no hub), trains on random tokens, and prints one line per
optimizer step so tests can act at a given step. Test-only knobs (never in user scripts):
--hold-save-at N makes the save at step N wait, after the Trainer wrote its files and before
jitckpt commits them, until --release-file exists; --wait-after-train waits the same way after
train() returns; --slow-save S makes every save (periodic or JIT) take S seconds longer;
--crash-at N makes rank 1 raise after step N, --kill-at N SIGKILL itself there (once each,
with --crash-marker; --crash-after DIR first waits, up to 60 s, until DIR holds a committed
save); --slow-write S holds each optimizer.pt written by jitckpt's background writer S seconds.
--save-model ends like TRL's scripts: trainer.save_model() into --output-dir (model, config,
tokenizer with --trainer sft) and a metrics JSON.
--strategy picks DDP (default), FSDP or DeepSpeed ZeRO (both through the test-only
`accelerate_on_cpu` shim: accelerate mishandles them on CPU ranks otherwise); --logging-steps 1
prints every step's loss; --cuda trains on the GPU (tests/gpu, bench_jit --cuda);
--eval-strategy evaluates on the first 32 training samples (one line per evaluation) and
--load-best lowest|highest loads the model with that eval loss at the end and prints its
checkpoint ("highest": the first evaluation is the best, training lowers the loss);
--best-metric lowest|highest tracks that best checkpoint without loading it at the end;
--early-stopping N adds HF's EarlyStoppingCallback with patience N.
--trainer card: a subclass whose `_save_checkpoint` writes a model card first (TRL's);
extra-state: one that writes a state of its own into each checkpoint (TRL GRPO's).
--checkpoint-callback adds a callback that reads each checkpoint at output_dir/checkpoint-N in
on_save, as W&B's checkpoint upload does, and adds a file of its own to it.
--oom-at N turns auto_find_batch_size on and raises an out-of-memory error at step N while the
batch is the first one (4): accelerate's find_executable_batch_size retries with 3.
--raise-at N makes every rank's first train() raise a ValueError after step N, which the script
catches (then goes on, to --second-stage).
--second-stage N trains the model on with a second Trainer for N steps (output_dir/stage2,
another learning rate, 'stage2 step N rank=R' lines), as a script with SFT then DPO does; each
stage's end prints a digest of the weights.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Subset
from transformers import (
    EarlyStoppingCallback,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

SEQ_LEN = 16
"""Tokens per sample (per_device_train_batch_size is 4)."""


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write: ranks share the pipe


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


STRATEGIES = ("ddp", "fsdp2-sharded", "fsdp2-full", "fsdp1-sharded", "hsdp", "zero2", "zero3")
"""FSDP1 FULL_STATE_DICT is left out: torch's FSDP1 state-dict hook segfaults on CPU."""


def strategy_args(strategy: str) -> dict[str, Any]:
    """TrainingArguments for a sharding strategy, the way users configure it."""
    if strategy == "ddp":
        return {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import accelerate_on_cpu

    accelerate_on_cpu.install()
    if strategy == "hsdp":  # FSDP2 sharded within a node, one replica per node (2-D mesh)
        from accelerate.parallelism_config import ParallelismConfig

        local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        mesh = ParallelismConfig(dp_replicate_size=world // local, dp_shard_size=local)
        return {**strategy_args("fsdp2-sharded"), "parallelism_config": mesh}
    if strategy.startswith("fsdp"):
        version, state_dict = strategy.removeprefix("fsdp").split("-")
        return {
            "fsdp": True,
            "fsdp_config": {
                "version": int(version),
                "state_dict_type": f"{state_dict.upper()}_STATE_DICT",
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                # FSDP1 would broadcast rank 0's weights from an accelerator device; every
                # rank builds the same seeded model anyway.
                "sync_module_states": False,
            },
        }
    if strategy.startswith("zero"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            sys.exit(f"--strategy {strategy}: no deepspeed; put .venv/deepspeed on PYTHONPATH")
        # use_cpu=False: accelerate ignores DeepSpeed when use_cpu=True.
        return {
            "use_cpu": False,
            "deepspeed": {
                "zero_optimization": {
                    "stage": int(strategy[-1]),
                    "stage3_gather_16bit_weights_on_model_save": True,
                },
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_force_ds_cpu_optimizer": False,
            },
        }
    raise ValueError(strategy)


class Progress(TrainerCallback):
    def __init__(self, step_sleep: float = 0.0, crash: tuple[int, str, str] = (0, "", "")) -> None:
        self.step_sleep = step_sleep
        self.crash_at, self.crash_marker, self.crash_after = crash

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.step_sleep)  # --step-sleep: a longer step, as a bigger model's

    def on_train_begin(self, args, state, control, **kwargs):
        say(f"begin rank={os.environ.get('RANK', '0')} pid={os.getpid()} step={state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):
        say(f"step {state.global_step} rank={os.environ.get('RANK', '0')}")
        crash = self.crash_at and state.global_step == abs(self.crash_at)
        crash = crash and os.environ.get("RANK") == "1"
        if crash and not os.path.exists(self.crash_marker):  # once: the restart goes on
            if self.crash_after:  # a snapshot's background write: committed, not racing it
                from jitckpt_entrypoint.protocol import validity

                deadline = time.monotonic() + 60
                while validity.committed(self.crash_after) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.crash_after} not committed in 60 s")
                    time.sleep(0.05)
            open(self.crash_marker, "w").close()
            if self.crash_at < 0:  # an OOM kill, a segfault: no Python left to unwind
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"worker crash injected at step {state.global_step}")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and state.is_world_process_zero:
            say(f"eval {state.global_step} {float(metrics['eval_loss'])!r}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.is_world_process_zero:
            say(f"loss {state.global_step} {float(logs['loss'])!r}")


class RaiseAt(TrainerCallback):
    """--raise-at: a bad batch on every rank, which the script catches."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise ValueError(f"bad batch at step {self.step}")


class OutOfMemory(TrainerCallback):
    """--oom-at: what CUDA raises when a batch does not fit, at that step of the first batch
    size (after a resume too, from a checkpoint saved with it)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.trainer: Any = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.trainer._train_batch_size == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


class HoldSave(TrainerCallback):
    """--hold-save-at: a callback with an on_save of its own (the Trainer's own save writes the
    checkpoint then, jitckpt commits it after)."""

    def __init__(self, hold_at: int, release: str) -> None:
        self.hold_at, self.release = hold_at, release

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.hold_at:
            say(f"holding save {state.global_step} rank={os.environ.get('RANK', '0')}")
            while not os.path.exists(self.release):
                time.sleep(0.01)


class CheckpointCallback(TrainerCallback):
    """--checkpoint-callback: W&B's WANDB_LOG_MODEL=checkpoint upload (it reads the checkpoint
    at output_dir/checkpoint-<step> in on_save), and a state of its own added to it."""

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(path):  # wandb's Artifact.add_dir
            raise ValueError(f"Path is not a directory: {path}")
        rank = os.environ.get("RANK", "0")
        say(f"on_save sees {' '.join(sorted(os.listdir(path)))} rank={rank}")
        with open(os.path.join(path, f"callback_state_{rank}.json"), "w") as f:
            json.dump({"step": state.global_step}, f)


class SlowSaveTrainer(Trainer):
    """A model so big that writing it takes `slow_save` seconds more (grace-period tests)."""

    slow_save = 0.0

    def save_model(self, *args, **kwargs):
        say(f"slow save rank={os.environ.get('RANK', '0')}")
        time.sleep(self.slow_save)
        return super().save_model(*args, **kwargs)


class CardTrainer(Trainer):
    """TRL's trainers' own `_save_checkpoint`: a model card into output_dir, then the Trainer's."""

    def _save_checkpoint(self, model, trial):
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(os.path.join(self.args.output_dir, "README.md"), "w") as f:
                f.write("# a model card\n")
        super()._save_checkpoint(model, trial)


class ExtraStateTrainer(Trainer):
    """TRL GRPOTrainer's with use_adaptive_entropy: a coefficient that changes in every step,
    written into the checkpoint after the Trainer's save and read back on resume."""

    coef = 1.0

    def compute_loss(self, *args, **kwargs):
        self.coef *= 0.99
        return super().compute_loss(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            ckpt = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            with open(os.path.join(ckpt, "extra_state.json"), "w") as f:
                json.dump({"coef": self.coef}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint or "", "extra_state.json")
        if checkpoint is not None and os.path.exists(path):
            with open(path) as f:
                self.coef = json.load(f)["coef"]


TRAINERS = {"hf": Trainer, "card": CardTrainer, "extra-state": ExtraStateTrainer}


def slow_background_writes(seconds: float) -> None:
    """Every optimizer.pt written off the main thread (jitckpt's background writer) is held
    `seconds` after its bytes are on disk, with a line, so tests can act mid-write."""
    import threading

    original = torch.save

    def save(obj, f, *args, **kwargs):
        result = original(obj, f, *args, **kwargs)
        if threading.current_thread() is not threading.main_thread() and str(f).endswith(
            "optimizer.pt"
        ):
            say(f"slow write {f} rank={os.environ.get('RANK', '0')}")
            time.sleep(seconds)
        return result

    torch.save = save


def tiny_llama(vocab: int, hidden: int, layers: int, dropout: float = 0.0) -> LlamaForCausalLM:
    """The script's model, randomly initialised from seed 0 (bench_write_interference too)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
    )
    return LlamaForCausalLM(config)


def build_args(opts: argparse.Namespace, cls: type = TrainingArguments) -> TrainingArguments:
    kwargs: dict[str, Any] = {"use_cpu": not opts.cuda, **strategy_args(opts.strategy)}
    best = opts.load_best or opts.best_metric
    return cls(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps if opts.epochs == 0 else -1,
        num_train_epochs=opts.epochs or 1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=opts.grad_accum,
        learning_rate=1e-3,
        logging_steps=opts.logging_steps,
        save_strategy=opts.save_strategy,
        save_steps=opts.save_steps,
        save_total_limit=opts.save_total_limit,
        eval_strategy=opts.eval_strategy,
        eval_steps=opts.save_steps,
        load_best_model_at_end=bool(opts.load_best),
        metric_for_best_model="eval_loss" if best else None,
        greater_is_better=best == "highest" if best else None,
        report_to="none",
        seed=42,
        dataloader_num_workers=opts.num_workers,
        disable_tqdm=True,
        enable_jit_checkpoint=opts.hf_jit,
        full_determinism=opts.deterministic,
        save_only_model=opts.save_only_model,
        auto_find_batch_size=bool(opts.oom_at),
        **kwargs,
    )


def main() -> None:
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # tests: stacks of a run stuck
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=0)
    parser.add_argument("--save-strategy", default="steps")
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--trainer", choices=["sft", *TRAINERS], default="hf")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout (RNG use)")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hf-jit", action="store_true", help="HF's own enable_jit_checkpoint")
    parser.add_argument("--eval-strategy", default="no", help="on the first 32 training samples")
    parser.add_argument("--load-best", choices=("lowest", "highest"), help="eval loss wanted")
    parser.add_argument(
        "--best-metric", choices=("lowest", "highest"), help="as --load-best, never loaded"
    )
    parser.add_argument("--early-stopping", type=int, default=0, help="its patience; 0: none")
    parser.add_argument(
        "--output-dir", default=os.path.join(tempfile.gettempdir(), "jitckpt-train_hf-output")
    )
    parser.add_argument("--save-model", action="store_true", help="save_model() after training")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU (tests/gpu, bench)")
    parser.add_argument(
        "--deterministic", action="store_true", help="HF's full_determinism (GPU kernels)"
    )
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument(
        "--resume-from", default=None, help="resume_from_checkpoint, as a plain HF script passes it"
    )
    parser.add_argument("--hold-save-at", type=int, default=-1)
    parser.add_argument("--checkpoint-callback", action="store_true")
    parser.add_argument("--second-stage", type=int, default=0, help="its steps; 0: none")
    parser.add_argument("--save-only-model", action="store_true", help="HF's save_only_model")
    parser.add_argument("--oom-at", type=int, default=0, help="an out-of-memory error there")
    parser.add_argument("--release-file", default="")
    parser.add_argument(
        "--wait-after-train", action="store_true", help="until --release-file exists"
    )
    parser.add_argument("--crash-at", type=int, default=0, help="rank 1 raises after this step")
    parser.add_argument("--kill-at", type=int, default=0, help="rank 1 SIGKILLs itself there")
    parser.add_argument("--raise-at", type=int, default=0, help="every rank raises there")
    parser.add_argument("--crash-marker", default="", help="created at the crash: crash once")
    parser.add_argument("--crash-after", default="", help="a save to wait for before the crash")
    parser.add_argument("--slow-save", type=float, default=0.0, help="seconds added to saves")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to steps")
    parser.add_argument(
        "--slow-write",
        type=float,
        default=0.0,
        help="seconds added to each optimizer.pt written off the main thread (async saves)",
    )
    opts = parser.parse_args()
    if opts.slow_write:
        slow_background_writes(opts.slow_write)

    model = tiny_llama(opts.vocab, opts.hidden, opts.layers, opts.dropout)
    callbacks: list[TrainerCallback] = [
        Progress(
            opts.step_sleep,
            (-opts.kill_at if opts.kill_at else opts.crash_at, opts.crash_marker, opts.crash_after),
        )
    ]
    if opts.hold_save_at >= 0:
        callbacks.append(HoldSave(opts.hold_save_at, opts.release_file))
    if opts.early_stopping:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=opts.early_stopping))
    oom = OutOfMemory(opts.oom_at)
    callbacks.extend([oom] if opts.oom_at else [])
    callbacks.extend([RaiseAt(opts.raise_at)] if opts.raise_at else [])
    data = RandomTokens(opts.samples, SEQ_LEN, opts.vocab)
    if opts.trainer == "sft":
        trainer = sft_trainer(opts, model, callbacks)
    else:
        trainer = (SlowSaveTrainer if opts.slow_save else TRAINERS[opts.trainer])(
            model=model,
            args=build_args(opts),
            train_dataset=data,
            eval_dataset=None if opts.eval_strategy == "no" else Subset(data, range(32)),
            callbacks=callbacks,
        )
    trainer.slow_save = opts.slow_save
    oom.trainer = trainer
    if opts.checkpoint_callback:  # added once the Trainer is built: after jitckpt's callback
        trainer.add_callback(CheckpointCallback())
    result = train(trainer, opts)
    if opts.strategy == "hsdp":  # the proof: replicated across nodes, sharded within one
        weight = next(trainer.model_wrapped.parameters())
        shape = dict(zip(weight.device_mesh.mesh_dim_names, weight.device_mesh.shape))
        say(f"mesh {shape} {weight.placements}")
    if opts.load_best or opts.best_metric:
        say(f"best {os.path.basename(str(trainer.state.best_model_checkpoint))}")
    if opts.save_model:
        trainer.save_model(opts.output_dir)
        trainer.save_metrics("train", result.metrics)
        say(f"saved model to {opts.output_dir} rank={os.environ.get('RANK', '0')}")
    if opts.second_stage:
        second_stage(opts, model, data)
    if opts.wait_after_train:  # stands for evaluation, export, push_to_hub after training
        while not os.path.exists(opts.release_file):
            time.sleep(0.01)


def train(trainer: Trainer, opts: argparse.Namespace):
    """trainer.train(); with --raise-at, the error it raises is caught (then None)."""
    try:
        result = trainer.train(resume_from_checkpoint=opts.resume_from)
    except ValueError as exc:
        if not opts.raise_at:
            raise
        say(f"caught {exc} rank={os.environ.get('RANK', '0')}")
        return None
    say(f"done step={result.global_step} rank={os.environ.get('RANK', '0')}")
    return result


class StageProgress(TrainerCallback):
    def __init__(self, step_sleep: float) -> None:
        self.step_sleep = step_sleep

    def on_step_end(self, args, state, control, **kwargs):
        say(f"stage2 step {state.global_step} rank={os.environ.get('RANK', '0')}")
        time.sleep(self.step_sleep)


def digest(model: torch.nn.Module) -> str:
    """The weights, bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def second_stage(opts: argparse.Namespace, model: LlamaForCausalLM, data: RandomTokens) -> None:
    """A second Trainer trains the first one's model on: other data, another learning rate."""
    rank = os.environ.get("RANK", "0")
    say(f"stage1 digest={digest(model)} rank={rank}")
    args = TrainingArguments(
        output_dir=os.path.join(opts.output_dir, "stage2"),
        max_steps=opts.second_stage,
        per_device_train_batch_size=4,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        save_steps=3,
        report_to="none",
        seed=7,
        use_cpu=True,
        disable_tqdm=True,
    )
    later = Trainer(
        model=model,
        args=args,
        train_dataset=Subset(data, range(len(data) // 2)),
        callbacks=[StageProgress(opts.step_sleep)],
    )
    result = later.train()
    say(f"stage2 done step={result.global_step} digest={digest(model)} rank={rank}")


def sft_trainer(opts: argparse.Namespace, model: LlamaForCausalLM, callbacks: list) -> Trainer:
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(120)]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    g = torch.Generator().manual_seed(7)
    texts = [
        " ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g))
        for _ in range(opts.samples)
    ]
    args = build_args(opts, SFTConfig)
    args.max_length = 16
    args.packing = False
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


if __name__ == "__main__":
    main()
