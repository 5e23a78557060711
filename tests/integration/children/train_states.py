"""One state of the state matrix (tests/system/test_states.py); it knows nothing about jitckpt.

Each state is a tiny, randomly initialised, seeded model built from a config (no hub) and a
Hugging Face Trainer set up the way users set up that state: an optimizer (`--state adamw_torch`,
torchao's 8-bit and 4-bit AdamW, schedule-free AdamW, Adafactor, bitsandbytes' 8-bit AdamW) on
the tiny Llama of train_hf.py, or a model feature with `adamw_torch` (a BatchNorm CNN, tied
embeddings, a PEFT LoRA adapter, bf16 autocast, gradient checkpointing). It trains --max-steps
steps on random data, saves a checkpoint every --save-steps, then saves the final model with
`trainer.save_model()` into --output-dir. It prints its torch and transformers versions
('stack ...') and one line per optimizer step ('step N rank=0'). The extra libraries
(torchao, schedulefree, bitsandbytes, peft) come from PYTHONPATH (.venv/states).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import transformers
from train_hf import SEQ_LEN, Progress, RandomTokens, say, tiny_llama
from transformers import Trainer, TrainingArguments

VOCAB, HIDDEN, LAYERS = 128, 32, 2
IMAGE = 16
"""Side of the ResNet's random RGB images."""
LABELS = 4

OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",  # torch's fused CPU kernel
    "adamw_torch_8bit",  # torchao: OptimState8bit tensor subclasses
    "adamw_torch_4bit",  # torchao: OptimState4bit tensor subclasses
    "schedule_free_adamw",  # schedulefree: swaps parameters in optimizer.train()/eval(); evaluated
    "adafactor",  # factored second moments: row and column vectors
    # bitsandbytes: uint8 block-wise moments for tensors of 4096 elements or more (lm_head
    # here; HF keeps embeddings at 32 bits), its state tucked into a nested dict.
    "adamw_bnb_8bit",
)
"""Optimizer states on the tiny Llama: --state is TrainingArguments.optim."""
MODELS = ("resnet_batchnorm", "tied_embeddings", "peft_lora", "bf16", "gradient_checkpointing")
"""Model states, with adamw_torch."""
STATES = (*OPTIMIZERS, *MODELS)


class RandomImages(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
        self.labels = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def tiny_resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_labels=LABELS,
    )
    return ResNetForImageClassification(config)


def tied_llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    config = tiny_llama(VOCAB, HIDDEN, LAYERS).config  # train_hf's one copy of the config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(VOCAB, HIDDEN, LAYERS)
    torch.manual_seed(1)  # LoRA's A matrices
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def build(state: str) -> tuple[torch.nn.Module, torch.utils.data.Dataset, dict[str, Any]]:  # noqa: PLR0911
    """The model, the data and the TrainingArguments that make `state`."""
    samples = 256
    tokens = RandomTokens(samples, SEQ_LEN, VOCAB)
    if state == "schedule_free_adamw":
        # An evaluation at every save: the Trainer's eval() and train() around it swap the
        # parameters in place, after the save and before the next forward.
        extra = {"optim": state, "eval_strategy": "steps"}
        return tiny_llama(VOCAB, HIDDEN, LAYERS), tokens, extra
    if state in OPTIMIZERS:
        return tiny_llama(VOCAB, HIDDEN, LAYERS), tokens, {"optim": state}
    if state == "resnet_batchnorm":
        return tiny_resnet(), RandomImages(samples), {}
    if state == "tied_embeddings":
        return tied_llama(), tokens, {}
    if state == "peft_lora":
        return lora_llama(), tokens, {}
    if state == "bf16":  # HF on CPU: bf16=True is autocast to bfloat16, fp32 master weights
        return tiny_llama(VOCAB, HIDDEN, LAYERS), tokens, {"bf16": True}
    if state == "gradient_checkpointing":
        return tiny_llama(VOCAB, HIDDEN, LAYERS), tokens, {"gradient_checkpointing": True}
    raise ValueError(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", choices=STATES, required=True)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--resume-from", default=None, help="resume_from_checkpoint, as a plain HF script passes it"
    )
    opts = parser.parse_args()
    say(f"stack torch {torch.__version__}, transformers {transformers.__version__}")

    model, data, extra = build(opts.state)
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=opts.save_steps,
        report_to="none",
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        eval_steps=opts.save_steps,
        **extra,
    )
    evaluated = RandomTokens(8, SEQ_LEN, VOCAB) if "eval_strategy" in extra else None
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=evaluated,
        callbacks=[Progress()],
    )
    result = trainer.train(resume_from_checkpoint=opts.resume_from)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    say(f"done step={result.global_step} optimizer={type(optimizer).__name__}")
    trainer.save_model(opts.output_dir)


if __name__ == "__main__":
    main()
