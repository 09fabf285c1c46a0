"""gradguard with the Hugging Face Trainer: guard_trainer and the bare callback both act before Trainer's clip."""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.docs import documented_example
from support.training import hf_training_args, make_policy, model_state
from torch import nn

from gradguard import GradientHalt

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradguard.integrations.transformers import STATE_FILE, GradGuardCallback, guard_trainer  # noqa: E402

NAN_PARAM = "transformer.h.1.mlp.c_fc.weight"


# --- tiny models, data and arguments ----------------------------------------------------------------


class TinyRegressor(nn.Module):
    """Two linear layers; returns {"loss": mse}. No dropout, so a plain torch loop can replay it exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y)}


def regression_data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(4, generator=gen) * 3, "y": torch.randn(1, generator=gen) * 20} for _ in range(n)]


class RecordingCollator:
    """Stacks examples into a batch and keeps a copy of every batch, in the order Trainer used them."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([example[key] for example in examples]) for key in examples[0]}
        self.batches.append({key: value.clone() for key, value in batch.items()})
        return batch


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def token_data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 32, (8,), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def training_args(tmp_path: Path, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "logging_steps": 1,
    }
    return hf_training_args(tmp_path, **(options | overrides))


HALT_ALL = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}


def no_nonfinite_parameter(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


class Snapshots(transformers.TrainerCallback):
    """Weights and optimizer state after each completed step, keyed by the steps completed."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.optimizer: dict[int, dict[str, Any]] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.weights[state.global_step] = model_state(model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any):
        self.weights[state.global_step] = model_state(model)
        self.optimizer[state.global_step] = copy.deepcopy(optimizer.state_dict())


class LogRecorder(transformers.TrainerCallback):
    """Stands for a reporting integration (report_to): it only sees what on_log hands it."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs))


def poison_at(trainer: Any, model: nn.Module, name: str, step: int) -> torch.utils.hooks.RemovableHandle:
    """From global step ``step`` on, the backward writes NaN into one element of ``name``'s gradient."""
    param = dict(model.named_parameters())[name]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if trainer.state.global_step < step:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    return param.register_hook(hook)


# --- the plain torch loop the Trainer runs are compared with ----------------------------------------


def reference_run(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    *,
    lr: float,
    clip: str,
    accumulation: int = 2,
    weight_decay: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Replays Trainer's maths on the recorded batches: loss / accumulation, backward per micro-batch, then
    ``clip`` ("policy-first": per-tensor clip_grad_norm_([p], 0.01) on first.*, then Trainer's global
    clip_grad_norm_(all, 1.0); "global-first": the reverse), then the AdamW Trainer builds (fused;
    two groups, biases without weight decay; TrainingArguments' weight_decay, 0.0 by default; constant LR)."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, fused=True
    )
    firsts = [p for n, p in model.named_parameters() if n.startswith("first.")]
    for start in range(0, len(batches), accumulation):
        for batch in batches[start : start + accumulation]:
            (model(**batch)["loss"] / accumulation).backward()
        if clip == "policy-first":
            for p in firsts:
                torch.nn.utils.clip_grad_norm_([p], 0.01)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for p in firsts:
                torch.nn.utils.clip_grad_norm_([p], 0.01)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


CLIP_FIRST = {"name": "first-layer", "match": "first.*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]}


def run_regression(tmp_path: Path, *, bare: bool) -> tuple[Any, RecordingCollator, nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = TinyRegressor()
    start = copy.deepcopy(model)
    collator = RecordingCollator()
    args = training_args(tmp_path, learning_rate=1e-2, lr_scheduler_type="constant")
    policy = make_policy(CLIP_FIRST)
    if bare:
        callback = GradGuardCallback(policy, logger=None)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=regression_data(), data_collator=collator, callbacks=[callback]
        )
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=regression_data(), data_collator=collator)
        callback = guard_trainer(trainer, policy, logger=None)
    trainer.train()
    return trainer, collator, start, {"callback": callback, "model": model}


# --- tests ------------------------------------------------------------------------------------------


def test_guard_trainer_clips_before_trainers_clip_exactly_as_a_plain_torch_loop(tmp_path, same):
    """guard_trainer, accumulation 2: weights equal bit for bit a torch loop doing per-tensor clip, then Trainer's."""
    trainer, collator, start, run = run_regression(tmp_path, bare=False)
    torch_adamw = trainer.optimizer.optimizer
    assert type(torch_adamw) is torch.optim.AdamW
    assert torch_adamw.defaults["fused"]
    assert [group["weight_decay"] for group in torch_adamw.param_groups] == [0.0, 0.0]
    batches = collator.batches[:6]  # 3 steps x 2 micro-batches (accelerate's loader fetches one more ahead)
    grad_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert all(norm > 1.0 for norm in grad_norms), "Trainer's max_grad_norm=1.0 clip really clipped"
    assert run["callback"].guard.counters.snapshot() == {"first-layer": {"clip_norm": 6}}  # 2 tensors x 3 steps
    assert run["callback"].guard.step_count == 3
    expected = reference_run(copy.deepcopy(start), batches, lr=1e-2, clip="policy-first")
    same(model_state(run["model"]), expected)
    wrong_order = reference_run(copy.deepcopy(start), batches, lr=1e-2, clip="global-first")
    assert not torch.equal(expected["second.weight"], wrong_order["second.weight"]), "the order is visible"


def test_bare_callback_acts_before_trainers_clip_too(tmp_path, same):
    """The callback alone (Trainer's clip is intercepted): a torch loop doing the policy's clip, then Trainer's."""
    _, collator, start, run = run_regression(tmp_path, bare=True)
    expected = reference_run(copy.deepcopy(start), collator.batches[:6], lr=1e-2, clip="policy-first")
    same(model_state(run["model"]), expected)
    assert run["callback"].guard.step_count == 3
    assert not run["callback"].guard.attached


def test_nan_in_one_gradient_halts_naming_that_parameter_with_the_default_max_grad_norm(tmp_path, same):
    """max_grad_norm=1.0: GradientHalt names the poisoned parameter at its step; weights as after the last good step."""
    model = tiny_gpt2()
    args = training_args(tmp_path, max_steps=4)
    assert args.max_grad_norm == 1.0
    snapshots = Snapshots()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[snapshots])
    callback = guard_trainer(trainer, make_policy(HALT_ALL), logger=None, audit_log=tmp_path / "audit.jsonl")
    handle = poison_at(trainer, model, NAN_PARAM, step=2)
    try:
        with pytest.raises(GradientHalt) as excinfo:
            trainer.train()
    finally:
        handle.remove()
    assert excinfo.value.params == (NAN_PARAM,)
    assert excinfo.value.step == 2
    assert trainer.state.global_step == 2
    same(model_state(model), snapshots.weights[2])
    same(trainer.optimizer.state_dict(), snapshots.optimizer[2])
    assert no_nonfinite_parameter(model)
    assert not callback.guard.attached, "guard_trainer removes the guard when train() raises"
    assert "unscale_gradients" not in vars(trainer.accelerator)
    assert "log" not in vars(trainer)


def test_bare_callback_halts_naming_the_poisoned_parameter_and_logs_counters(tmp_path, same):
    """Only callbacks=[GradGuardCallback(...)] and max_grad_norm=1.0: the halt names the one parameter; counters
    are in state.log_history."""
    model = tiny_gpt2()
    snapshots = Snapshots()
    policy = make_policy(
        {"name": "clip", "match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}, HALT_ALL
    )
    callback = GradGuardCallback(policy, logger=None)
    args = training_args(tmp_path, max_steps=4, logging_steps=1)
    assert args.max_grad_norm == 1.0
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[snapshots, callback])
    handle = poison_at(trainer, model, NAN_PARAM, step=2)
    try:
        with pytest.raises(GradientHalt) as excinfo:
            trainer.train()
    finally:
        handle.remove()
        callback.remove()  # a bare callback cannot see the exception: the guard stays attached until removed
    assert excinfo.value.step == 2
    assert excinfo.value.params == (NAN_PARAM,)
    same(model_state(model), snapshots.weights[2])
    assert no_nonfinite_parameter(model)
    logged = [entry for entry in trainer.state.log_history if "gradguard/clip/clip_norm" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    assert logged[0]["gradguard/clip/clip_norm"] > 0
    assert logged[1]["gradguard/clip/clip_norm"] > logged[0]["gradguard/clip/clip_norm"]


def test_counters_reach_log_history_and_every_on_log_callback(tmp_path):
    """gradguard/<rule>/<action> keys are in state.log_history and in the logs a reporting callback receives."""
    model = tiny_gpt2()
    recorder = LogRecorder()
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=token_data())
    trainer.callback_handler.callbacks.insert(0, recorder)  # where report_to integrations sit: before ours
    policy = make_policy(
        HALT_ALL, {"name": "attn", "match": "*.attn.*", "actions": [{"action": "clip_norm", "max_norm": 1e-4}]}
    )
    callback = guard_trainer(trainer, policy, logger=None)
    trainer.train()
    step_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in step_logs] == [1, 2, 3]
    per_step = 8  # c_attn and c_proj, weight and bias, in 2 layers
    assert [entry["gradguard/attn/clip_norm"] for entry in step_logs] == [per_step, 2 * per_step, 3 * per_step]
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final
    assert final["gradguard/attn/clip_norm"] == 3 * per_step
    seen = [entry for entry in recorder.logs if "loss" in entry]
    assert [entry["gradguard/attn/clip_norm"] for entry in seen] == [per_step, 2 * per_step, 3 * per_step]
    assert callback.guard.counters.snapshot() == {"attn": {"clip_norm": 3 * per_step}}
    assert not callback.guard.attached


def test_a_monitors_figures_reach_log_history_beside_the_counters(tmp_path):
    """With a monitor rule, each training log entry holds gradguard/<rule>/norm/<name> for every parameter."""
    model = tiny_gpt2()
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=token_data())
    policy = make_policy({"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"]}]})
    callback = guard_trainer(trainer, policy, logger=None)
    trainer.train()
    names = {name for name, _ in model.named_parameters()}
    step_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert step_logs
    for entry in step_logs:
        prefix = "gradguard/health/norm/"
        assert {key.removeprefix(prefix) for key in entry if key.startswith(prefix)} == names
        assert all(entry[f"gradguard/health/norm/{name}"] > 0 for name in names)
    final = callback.guard.metrics()
    assert {k: v for k, v in step_logs[-1].items() if k.startswith("gradguard/health/")} == {
        k: v for k, v in final.items() if k.startswith("gradguard/health/")
    }


def test_resumed_run_carries_on_the_guard_step_numbers(tmp_path, read_audit):
    """Stop at a checkpoint, resume with a new Trainer: attach start_step and event steps continue; a window holds."""
    policy = make_policy(
        HALT_ALL,
        {"name": "warmup", "match": "*", "until_step": 3, "actions": [{"action": "clip_norm", "max_norm": 1e-4}]},
    )
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)

    class StopAtTwo(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                control.should_training_stop = True

    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data(), callbacks=[StopAtTwo()])
    first = guard_trainer(trainer, policy, logger=None, audit_log=first_log)
    trainer.train()
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    assert json.loads((checkpoint / STATE_FILE).read_text())["step"] == 2
    assert first.guard.step_count == 2

    resumed = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data())
    second = guard_trainer(resumed, policy, logger=None, audit_log=second_log)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert second.guard.step_count == 4

    events = read_audit(second_log)
    attach = events[0]
    assert attach["event"] == "attach"
    assert attach["start_step"] == 2
    assert [e["step"] for e in events if e["event"] == "state_loaded"] == [2]
    clipped_steps = sorted({e["step"] for e in events if e["event"] == "intervention"})
    assert clipped_steps == [2], "the warm-up clip (steps 0-2) acts on step 2 only, not from 0 again"
    assert sorted({e["step"] for e in read_audit(first_log) if e["event"] == "intervention"}) == [0, 1]
    assert second.guard.counters.snapshot()["warmup"]["clip_norm"] > 0


def test_a_resumed_run_carries_the_adaptive_statistics_through_the_checkpoint(tmp_path):
    """zclip and autoclip statistics go into gradguard_state.json and come back: the resumed run ends with the
    statistics of the run that was never stopped."""
    policy = make_policy(
        HALT_ALL,
        {"name": "z", "match": "*", "actions": [{"action": "zclip", "warmup_steps": 1, "scope": "group"}]},
        {"name": "auto", "match": "*", "actions": [{"action": "autoclip", "history": 3, "percentile": 20.0}]},
    )

    class StopAtTwo(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                control.should_training_stop = True

    straight_args = training_args(tmp_path / "straight", max_steps=4)
    straight = transformers.Trainer(model=tiny_gpt2(), args=straight_args, train_dataset=token_data())
    whole = guard_trainer(straight, policy, logger=None)
    straight.train()

    args = training_args(tmp_path / "stopped", max_steps=4, save_strategy="steps", save_steps=2)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data(), callbacks=[StopAtTwo()])
    guard_trainer(trainer, policy, logger=None)
    trainer.train()
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    assert set(saved["statistics"]) == {"z", "auto"}

    resumed = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data())
    second = guard_trainer(resumed, policy, logger=None)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert second.guard.step_count == whole.guard.step_count == 4
    assert second.guard.state_dict()["statistics"] == whole.guard.state_dict()["statistics"]
    assert whole.guard.counters.snapshot()["auto"]["autoclip"] > 0


def test_resume_true_finds_the_last_checkpoint_and_its_guard_state(tmp_path, read_audit):
    """resume_from_checkpoint=True: the guard state beside the last checkpoint is read (a state_loaded event)."""
    args = training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data())
    guard_trainer(trainer, make_policy(HALT_ALL), logger=None)
    trainer.train()
    log = tmp_path / "resumed.jsonl"
    more = training_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=2)
    resumed = transformers.Trainer(model=tiny_gpt2(), args=more, train_dataset=token_data())
    callback = guard_trainer(resumed, make_policy(HALT_ALL), logger=None, audit_log=log)
    resumed.train(resume_from_checkpoint=True)
    events = read_audit(log)
    assert events[0]["start_step"] == 2
    assert [e["step"] for e in events if e["event"] == "state_loaded"] == [2]
    assert callback.guard.step_count == 3


def test_a_second_train_call_gets_a_new_guard_and_the_wrappers_are_undone_between(tmp_path):
    """Each train() attaches a fresh guard at global_step; between runs Trainer's own methods are back."""
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=training_args(tmp_path, max_steps=1), train_dataset=token_data()
    )
    callback = guard_trainer(trainer, make_policy(HALT_ALL), logger=None)
    trainer.train()
    first = callback.guard
    assert first is not None
    assert not first.attached
    assert "log" not in vars(trainer)
    assert "unscale_gradients" not in vars(trainer.accelerator)
    trainer.train()
    assert callback.guard is not first
    assert callback.guard.step_count == 1
    assert not callback.guard.attached


def test_start_step_is_refused_because_it_comes_from_the_trainer():
    """GradGuardCallback(policy, start_step=5) is a TypeError: the Trainer's global_step decides."""
    with pytest.raises(TypeError, match="start_step"):
        GradGuardCallback(make_policy(HALT_ALL), start_step=5)


@pytest.mark.parametrize(
    ("module", "hidden"),
    [("gradguard.integrations.transformers", "transformers"), ("gradguard.integrations.accelerate", "accelerate")],
)
def test_importing_without_the_framework_says_how_to_install_it(monkeypatch, module, hidden):
    """With the framework missing, the import fails with pip install 'gradguard[transformers]'."""
    for name in list(sys.modules):
        if name in (module, hidden) or name.startswith(hidden + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, hidden, None)
    monkeypatch.delitem(sys.modules, "gradguard.integrations.accelerate", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'gradguard\[transformers\]'"):
        importlib.import_module(module)


# --- the documentation's examples, as written -------------------------------------------------------

HF_TRAINER_EXAMPLE = """\
import torch
import transformers

from gradguard import Policy
from gradguard.integrations.transformers import guard_trainer

torch.manual_seed(0)
config = transformers.GPT2Config(
    n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
)
model = transformers.GPT2LMHeadModel(config)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (16, 8))]
args = transformers.TrainingArguments(
    output_dir="hf-out",
    max_steps=4,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    logging_steps=2,
    report_to=[],  # or "wandb", "tensorboard", ...: they receive the gradguard/... keys too
    save_strategy="no",
    use_cpu=True,  # drop on a GPU
)
policy = Policy.from_dict(
    {
        "version": 1,
        "rules": [
            {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
            {"name": "attention", "match": "*.attn.*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
        ],
    }
)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
callback = guard_trainer(trainer, policy, audit_log="hf-run.jsonl")  # or a policy file's path
trainer.train()  # a NaN/Inf gradient raises GradientHalt naming its parameter, before Trainer's clip
print(callback.guard.counters.snapshot())  # e.g. {'attention': {'clip_norm': 17}}
print(trainer.state.log_history[-1]["gradguard/attention/clip_norm"])  # the same count (cumulative in every log)
"""

ACCELERATE_EXAMPLE = """\
import torch
from accelerate import Accelerator
from torch import nn

from gradguard import Policy
from gradguard.integrations.accelerate import guard_accelerator

torch.manual_seed(0)
accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)  # drop cpu=True on a GPU
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
with guard_accelerator(accelerator, model, Policy.shipped("default"), audit_log="accelerate-run.jsonl") as guard:
    for step in range(20):
        x = torch.randn(32, 16)
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the guard acts first, inside
            opt.step()
            opt.zero_grad()
print(guard.step_count, guard.counters.snapshot())  # 10 optimizer steps
"""

EXAMPLES = {"hf-trainer": HF_TRAINER_EXAMPLE, "accelerate": ACCELERATE_EXAMPLE}


def test_the_documented_examples_are_the_ones_tested():
    """docs/frameworks.md holds exactly the code the next test runs, for each example."""
    documented = {
        "hf-trainer": documented_example("docs/frameworks.md", "hf-trainer"),
        "accelerate": documented_example("docs/frameworks.md", "accelerate"),
    }
    assert documented == EXAMPLES


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_documented_example_runs_as_written(name, tmp_path, monkeypatch, read_audit):
    """Each example runs in an empty directory, guards, logs, and leaves no guard attached."""
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(EXAMPLES[name], f"<{name} example>", "exec"), {"__name__": "__example__"})
    log = tmp_path / ("hf-run.jsonl" if name == "hf-trainer" else "accelerate-run.jsonl")
    events = read_audit(log)
    assert events[0]["event"] == "attach"
    assert events[-1]["event"] == "detach"
    printed = out.getvalue()
    if name == "hf-trainer":
        assert re.search(r"\{'attention': \{'clip_norm': \d+\}\}", printed), printed
    else:
        assert printed.splitlines()[-1] == "10 {}", printed  # the default changes nothing in a healthy run
