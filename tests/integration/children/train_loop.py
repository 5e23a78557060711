"""A plain PyTorch DDP loop (gloo) that uses jitckpt's public API: the README example, runnable."""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from jitckpt_entrypoint import hook as jitckpt


class AppState(Stateful):
    """Model, optimizer and step in one object torch.distributed.checkpoint can save and load."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.step = sd["step"]


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--async-save", action="store_true", help="jitckpt.save(async_=True)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to steps")
    parser.add_argument("--slow-from", type=int, default=0, help="--slow-sleep from this step")
    parser.add_argument("--slow-sleep", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=32, help="the hidden layer (benches)")
    parser.add_argument("--no-done", action="store_true", help="never call jitckpt.done()")
    parser.add_argument("--post-sleep", type=float, default=0.0, help="work on after training")
    opts = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(16, opts.width), torch.nn.Tanh(), torch.nn.Linear(opts.width, 1)
        )
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    app = AppState(model, optimizer)
    state = {"app": app}

    path = jitckpt.latest_checkpoint()
    if path is not None:
        jitckpt.load(state, path)
    say(f"begin rank={rank} pid={os.getpid()} step={app.step}")

    for step in range(app.step + 1, opts.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)  # data depends only on (step, rank)
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        slow = opts.slow_from and step >= opts.slow_from
        time.sleep(opts.slow_sleep if slow else opts.step_sleep)
        app.step = step
        say(f"step {step} rank={rank}")
        if jitckpt.should_stop(step):
            jitckpt.save(state, step, kind="jit")  # commits, then exits with JITCKPT_EXIT_CODE
        timed = jitckpt.should_save()  # JITCKPT_SAVE_INTERVAL: every rank at the same step
        if timed:
            say(f"timed save at step {step} rank={rank}")
        if (timed or step % opts.save_every == 0) and step < opts.steps:
            jitckpt.save(state, step, async_=opts.async_save)
        elif jitckpt.should_snapshot(step):  # JITCKPT_MEMORY_DIR: a snapshot in RAM
            jitckpt.snapshot(state, step)
    jitckpt.save(state, opts.steps, kind="final")
    if not opts.no_done:
        jitckpt.done()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    say(f"weights {digest.hexdigest()} rank={rank}")
    say(f"done step={app.step} rank={rank}")
    dist.destroy_process_group()
    if opts.post_sleep:  # an evaluation, an export: the script works on after training
        say(f"post-training work rank={rank}")
        time.sleep(opts.post_sleep)
        say(f"post-training work done rank={rank}")


if __name__ == "__main__":
    main()
