"""A tiny, deterministic Hugging Face training script; it knows nothing about jitckpt.

Builds a 2-layer Llama from a config (no hub), trains on random tokens, and prints one line per
optimizer step so tests can act at a given step. Test-only knobs (never in user scripts):
--hold-save-at N makes the save at step N wait, after the Trainer wrote its files and before
jitckpt commits them, until --release-file exists; --wait-after-train waits the same way after
train() returns; --slow-save S makes every save (periodic or JIT) take S seconds longer.
--save-model ends like TRL's scripts: trainer.save_model() into --output-dir (model, config,
tokenizer with --trainer sft) and a metrics JSON.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


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


class Progress(TrainerCallback):
    def __init__(self, hold_at: int, release: str) -> None:
        self.hold_at, self.release = hold_at, release

    def on_train_begin(self, args, state, control, **kwargs):
        say(f"begin rank={os.environ.get('RANK', '0')} pid={os.getpid()} step={state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):
        say(f"step {state.global_step} rank={os.environ.get('RANK', '0')}")

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.hold_at:
            say(f"holding save {state.global_step} rank={os.environ.get('RANK', '0')}")
            while not os.path.exists(self.release):
                time.sleep(0.01)


class SlowSaveTrainer(Trainer):
    """A model so big that writing it takes `slow_save` seconds more (grace-period tests)."""

    slow_save = 0.0

    def save_model(self, *args, **kwargs):
        say(f"slow save rank={os.environ.get('RANK', '0')}")
        time.sleep(self.slow_save)
        return super().save_model(*args, **kwargs)


def build_args(opts: argparse.Namespace, cls: type = TrainingArguments) -> TrainingArguments:
    return cls(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps if opts.epochs == 0 else -1,
        num_train_epochs=opts.epochs or 1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=opts.grad_accum,
        learning_rate=1e-3,
        logging_steps=5,
        save_strategy=opts.save_strategy,
        save_steps=opts.save_steps,
        report_to="none",
        use_cpu=True,
        seed=42,
        dataloader_num_workers=opts.num_workers,
        disable_tqdm=True,
        enable_jit_checkpoint=opts.hf_jit,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=0)
    parser.add_argument("--save-strategy", default="steps")
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--trainer", choices=["hf", "sft"], default="hf")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hf-jit", action="store_true", help="HF's own enable_jit_checkpoint")
    parser.add_argument(
        "--output-dir", default=os.path.join(tempfile.gettempdir(), "jitckpt-train_hf-output")
    )
    parser.add_argument("--save-model", action="store_true", help="save_model() after training")
    parser.add_argument("--hold-save-at", type=int, default=-1)
    parser.add_argument("--release-file", default="")
    parser.add_argument(
        "--wait-after-train", action="store_true", help="until --release-file exists"
    )
    parser.add_argument("--slow-save", type=float, default=0.0, help="seconds added to saves")
    opts = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=opts.vocab,
        hidden_size=opts.hidden,
        intermediate_size=opts.hidden * 2,
        num_hidden_layers=opts.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    callbacks = [Progress(opts.hold_save_at, opts.release_file)]
    if opts.trainer == "sft":
        trainer = sft_trainer(opts, model, callbacks)
    else:
        trainer = (SlowSaveTrainer if opts.slow_save else Trainer)(
            model=model,
            args=build_args(opts),
            train_dataset=RandomTokens(opts.samples, 16, config.vocab_size),
            callbacks=callbacks,
        )
    trainer.slow_save = opts.slow_save
    result = trainer.train()
    say(f"done step={result.global_step} rank={os.environ.get('RANK', '0')}")
    if opts.save_model:
        trainer.save_model(opts.output_dir)
        trainer.save_metrics("train", result.metrics)
        say(f"saved model to {opts.output_dir} rank={os.environ.get('RANK', '0')}")
    if opts.wait_after_train:  # stands for evaluation, export, push_to_hub after training
        while not os.path.exists(opts.release_file):
            time.sleep(0.01)


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
