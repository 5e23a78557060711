"""TRL's own `trl sft` CLI on a tiny model, tokenizer and dataset built locally (no hub)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.procs import Proc, wait_for

TRL = str(Path(sys.executable).parent / "trl")
WORDS = [f"w{i}" for i in range(120)]


def build(root: Path) -> tuple[Path, Path]:
    """A 2-layer Llama with a word-level tokenizer (and chat template) in root/model, and a
    512-line text dataset in root/data/train.jsonl; returns (model dir, data dir)."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
    )
    model_dir, data_dir = root / "model", root / "data"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_dir.mkdir(parents=True)
    g = torch.Generator().manual_seed(7)
    with (data_dir / "train.jsonl").open("w") as f:
        for _ in range(512):
            picks = torch.randint(0, len(WORDS), (12,), generator=g)
            f.write(json.dumps({"text": " ".join(WORDS[int(i)] for i in picks)}) + "\n")
    return model_dir, data_dir


def command(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    """`trl sft` as a user runs it: no launcher flags (accelerate's simple launcher)."""
    return [
        TRL,
        "sft",
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(output),
        "--max_length",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--report_to",
        "none",
        "--logging_steps",
        "1",  # one log line per optimizer step: the tests count them
        "--disable_tqdm",
        "true",
        "--bf16",
        "false",  # SFTConfig's default needs a GPU
        "--use_cpu",
        "true",
        *extra,
    ]


def steps_logged(proc: Proc) -> int:
    """Optimizer steps done so far: HF's Trainer prints one loss line per step here."""
    return sum(1 for line in proc.stdout if line.startswith("{'loss'"))


def wait_for_steps(proc: Proc, steps: int, timeout: float = 180) -> None:
    def done() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"exited before step {steps}\n{proc.output()}")
        return steps_logged(proc) >= steps

    wait_for(done, timeout, f"step {steps} of trl sft")
