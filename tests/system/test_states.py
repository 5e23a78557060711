"""The state matrix: real optimizers and model features, each trained plainly and under jitckpt.

The hook is injected into every Python process, so a run that works without jitckpt must work
with it, and every checkpoint jitckpt commits must be exactly the state of its step. For each
state of tests/integration/children/train_states.py (torchao's 8-bit and 4-bit AdamW,
schedule-free AdamW, Adafactor, bitsandbytes 8-bit AdamW, a BatchNorm CNN, tied embeddings, a
PEFT LoRA adapter, bf16 autocast, gradient checkpointing, ...), on one CPU process each:

1. the script exits 0 run plainly and under jitckpt-entrypoint (side by side: two cores);
2. the checkpoint jitckpt committed at step SAVE_AT (in the background when the hook's fast
   path covers the state, else by the Trainer's own save) is file for file the one plain HF
   wrote at that step (bytes; BY_CONTENT's files by content); the path taken is EXPECTED_FAST's;
3. rerun under jitckpt after deleting the checkpoints past SAVE_AT, it resumes there by itself
   and ends with the final weights (`trainer.save_model()`) of the uninterrupted plain run.

The extra libraries come from `.venv/states` (make installs requirements-states.txt there with
--no-deps), on PYTHONPATH only for the states that need them: transformers imports torchao in
every process that can find it. JITCKPT_TEST_PYTHON runs the training child under another
interpreter (`make test-oldest`: .venv-oldest, the oldest supported torch and transformers) with
its own `states` directory beside its bin/ (requirements-oldest-states.txt: the releases of
those libraries that run on that stack); the entrypoint and pytest stay this venv's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file

from harness.procs import Proc
from harness.training import CHILDREN, entrypoint, hook_lines, steps_seen

pytestmark = [pytest.mark.integration, pytest.mark.untimed]

TRAIN_STATES = CHILDREN / "train_states.py"
PYTHON = os.environ.get("JITCKPT_TEST_PYTHON") or sys.executable
"""The training child's interpreter (make test-oldest: .venv-oldest/bin/python)."""
STATES_DIR = Path(PYTHON).parent.parent / "states"
"""The extra libraries for PYTHON's stack (make: pip install --no-deps --target)."""
SAVE_AT, TOTAL = 4, 8

STATES = [
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_8bit",
    "adamw_torch_4bit",
    "schedule_free_adamw",
    "adafactor",
    "adamw_bnb_8bit",
    "resnet_batchnorm",
    "tied_embeddings",
    "peft_lora",
    "bf16",
    "gradient_checkpointing",
]
NEEDS = {
    "adamw_torch_8bit": "torchao",
    "adamw_torch_4bit": "torchao",
    "schedule_free_adamw": "schedulefree",
    "adamw_bnb_8bit": "bitsandbytes",
    "peft_lora": "peft",
}
"""The library from STATES_DIR each state needs (the others need none: STATES_DIR stays off
their PYTHONPATH)."""
EXPECTED_FAST = {
    "adamw_torch": True,
    "adamw_torch_fused": True,
    # torchao's optimizer states are tensor subclasses (OptimState8bit, OptimState4bit) that the
    # snapshot cannot copy: the Trainer's own save.
    "adamw_torch_8bit": False,
    "adamw_torch_4bit": False,
    "schedule_free_adamw": True,
    "adafactor": True,
    "adamw_bnb_8bit": True,
    "resnet_batchnorm": True,
    "tied_embeddings": True,
    "peft_lora": False,  # "PEFT adapters are small: their save is quick as it is"
    "bf16": True,
    "gradient_checkpointing": True,
}
"""Whether jitckpt writes the state's periodic checkpoints in the background (its fast path)
or leaves them to the Trainer's own save."""
FALLBACK_WORDS = ("Trainer's own save", "saves stay synchronous", "async saves off")
"""Words of the hook's log lines that say why a save is not its fast path."""
BY_CONTENT = ("trainer_state.json", "training_args.bin", "adapter_config.json")
"""Compared by content; every other file of a checkpoint byte for byte. The first two name the
run's directories (left out) and the trainer state logs evaluations' wall-clock timings (left
out); PEFT writes its set-valued fields (target_modules) in the process's string-hash order
(compared sorted)."""


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Each state's row of the table printed at the end of the module (and the child's stack,
    as its plain run printed it, under "stack")."""
    rows: dict[str, str] = {}
    yield rows
    header = f"state matrix: {PYTHON} ({rows.get('stack', '?')})"
    lines = [header, *(f"  {state:24} {rows[state]}" for state in STATES if state in rows)]
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + "\n".join(lines))


def child_env(base_env: dict[str, str], state: str) -> dict[str, str]:
    env = dict(base_env)
    if state in NEEDS:
        env["PYTHONPATH"] = str(STATES_DIR)
    return env


def train(state: str, out: Path) -> list[str]:
    return [
        PYTHON,
        str(TRAIN_STATES),
        *("--state", state, "--output-dir", str(out)),
        *("--max-steps", str(TOTAL), "--save-steps", str(SAVE_AT)),
    ]


def finish(*procs: Proc) -> list[int]:
    """Wait for processes started side by side; their exit codes, in order."""
    return [proc.wait(timeout=600) for proc in procs]


def path_taken(proc: Proc) -> tuple[bool, str]:
    """(fast, how): whether the hook wrote checkpoint-SAVE_AT in the background, and, when it
    did not, the hook's words for why (the Trainer's own save)."""
    committed = hook_lines(proc, f"committed checkpoint-{SAVE_AT} ")
    assert len(committed) == 1, proc.output()
    if "async: training blocked" in committed[0]:
        return True, "fast (async)"
    why = [
        line.split(" INFO ", 1)[-1]
        for line in proc.stderr
        if "jitckpt-hook" in line and any(words in line for words in FALLBACK_WORDS)
    ]
    switched = " (async on at the start)" if hook_lines(proc, "async periodic saves on") else ""
    return False, f"Trainer's save{switched}: " + (" / ".join(why) or "(no reason logged)")


def compare_checkpoints(expected: Path, got: Path) -> list[str]:
    """How `got` (jitckpt's checkpoint) differs from `expected` (plain HF's), file by file."""
    names = {p.relative_to(expected).as_posix() for p in expected.rglob("*") if p.is_file()}
    ours = {
        p.relative_to(got).as_posix()
        for p in got.rglob("*")
        if p.is_file() and not p.name.startswith("jitckpt-manifest.")
    }
    problems = [f"{name}: missing" for name in sorted(names - ours)]
    problems += [f"{name}: not in HF's checkpoint" for name in sorted(ours - names)]
    for name in sorted(names & ours):
        a, b = expected / name, got / name
        if name in BY_CONTENT:
            diff = same_content(load_any(a), load_any(b), name)
            if diff:
                problems.append(f"{name}: {diff}")
        elif a.read_bytes() != b.read_bytes():
            problems.append(f"{name}: bytes differ ({content_diagnosis(a, b, name)})")
    return problems


def load_any(path: Path) -> Any:
    """A checkpoint file's content, the paths of the run left out."""
    if path.suffix == ".json":
        content = json.loads(path.read_text())
        content.pop("best_model_checkpoint", None)
        for entry in content.get("log_history", []):  # wall-clock timings of the evaluations
            for key in [k for k in entry if k.endswith(("_runtime", "_per_second"))]:
                del entry[key]
        if path.name == "adapter_config.json":
            content = {k: sorted(v) if is_strings(v) else v for k, v in content.items()}
        return content
    if path.suffix == ".safetensors":
        return load_file(str(path))
    obj = torch.load(path, weights_only=False)
    if path.name == "training_args.bin":
        obj = obj.to_dict()
        for key in ("output_dir", "logging_dir"):
            obj.pop(key, None)
    return obj


def is_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def content_diagnosis(a: Path, b: Path, name: str) -> str:
    if a.suffix not in (".safetensors", ".pt", ".pth", ".bin", ".json"):
        return "not a tensor file"
    try:
        diff = same_content(load_any(a), load_any(b), name)
    except Exception as exc:  # noqa: BLE001 - a diagnosis for the failure message only
        return f"cannot load: {exc!r}"
    return diff or "same content"


def same_content(a: Any, b: Any, where: str) -> Optional[str]:
    """None when `a` and `b` hold the same values (tensors: same type, dtype, shape and values;
    tensor subclasses: the same inner tensors), else where they first differ."""
    if type(a) is type(b) and type(a).__module__ == "numpy":  # the numpy RNG state's array
        a, b = a.tolist(), b.tolist()
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        return same_tensor(a, b, where)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        pairs = [(a[k], b[k], f"{where}[{k!r}]") for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        pairs = [(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    else:
        same = a == b or (a != a and b != b)  # noqa: PLR0124 - NaN equals NaN here
        return None if same else f"{where}: {a!r} != {b!r}"
    return next((d for x, y, w in pairs if (d := same_content(x, y, w))), None)


def same_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> Optional[str]:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
    flatten = getattr(a, "__tensor_flatten__", None)
    if type(a) not in (torch.Tensor, torch.nn.Parameter) and flatten is not None:
        inner, meta = flatten()
        inner_b, meta_b = b.__tensor_flatten__()
        if inner != inner_b or repr(meta) != repr(meta_b):
            return f"{where}: {type(a).__name__} layout differs"
        for name in inner:
            diff = same_tensor(getattr(a, name), getattr(b, name), f"{where}.{name}")
            if diff:
                return diff
        return None
    if not torch.equal(a, b):
        return f"{where}: values differ"
    return None


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """What `trainer.save_model()` wrote: the model, or the PEFT adapter."""
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (out / name).exists():
            return load_file(str(out / name))
    raise AssertionError(f"no weights saved in {out}: {sorted(p.name for p in out.iterdir())}")


def weights_diff(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    if expected.keys() != got.keys():
        return [f"tensors {sorted(expected.keys() ^ got.keys())} in one only"]
    return [
        f"{k}: {expected[k].dtype} vs {got[k].dtype}"
        if expected[k].dtype != got[k].dtype
        else f"{k}: max abs diff {(expected[k].float() - got[k].float()).abs().max().item()}"
        for k in sorted(expected)
        if expected[k].dtype != got[k].dtype or not torch.equal(expected[k], got[k])
    ]


@pytest.mark.parametrize("state", STATES)
def test_state_trains_checkpoints_and_resumes_as_without_jitckpt(
    state, spawn, base_env, jdir, tmp_path, matrix
):
    """Under jitckpt the script exits 0 as it does plainly; checkpoint-SAVE_AT is plain HF's,
    written on EXPECTED_FAST's path; a rerun resumes from it to the plain run's final weights.

    The reference is the uninterrupted plain run: plain HF's own resume from its
    checkpoint-SAVE_AT ends with the same weights for every state here, on both stacks."""
    needs = NEEDS.get(state)
    assert needs is None or (STATES_DIR / needs).is_dir(), (
        f"{needs} is not installed in {STATES_DIR} (make installs it there)"
    )
    env = child_env(base_env, state)
    plain_out, ours_out, resumed_out = tmp_path / "plain", tmp_path / "ours", tmp_path / "resumed"

    plain = spawn(train(state, plain_out), env=env)
    ours = spawn(entrypoint(train(state, ours_out)), env=env)
    codes = finish(plain, ours)
    matrix[state] = f"exit {codes[0]}/{codes[1]}"
    assert codes == [0, 0], f"exit codes plain, jitckpt: {codes}\n{plain.output()}\n{ours.output()}"
    matrix.setdefault("stack", plain.expect(r"^stack (.*)$").group(1))
    fast, how = path_taken(ours)
    matrix[state] += f" | {how}"

    ckpt = f"checkpoint-{SAVE_AT}"
    differs = compare_checkpoints(plain_out / ckpt, jdir / "checkpoints" / ckpt)
    matrix[state] += " | checkpoint " + (
        "equal" if not differs else "DIFFERS: " + "; ".join(differs)
    )

    for path in (jdir / "checkpoints").glob("checkpoint-*"):
        if int(path.name.split("-")[1]) > SAVE_AT:
            shutil.rmtree(path)
    resumed = spawn(entrypoint(train(state, resumed_out)), env=env)
    assert resumed.wait(timeout=600) == 0, resumed.output()
    assert min(steps_seen(resumed)) == SAVE_AT + 1, resumed.output()
    wrong = weights_diff(final_weights(plain_out), final_weights(resumed_out))
    matrix[state] += " | resume " + ("exact" if not wrong else "NOT EXACT")
    print(f"{state}: {matrix[state]}")

    assert fast == EXPECTED_FAST[state], f"{state}: {how}\n{ours.output()}"
    assert not differs, f"{state}: {ckpt} differs from plain HF's: {differs}"
    assert not wrong, f"{state}: resumed weights differ from the plain run's: {wrong[:5]}"
