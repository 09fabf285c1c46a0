"""One definition of each event (gradguard.events.definitions): the docs list the same events, levels and fields,
and every line real guarded runs write fits its definition exactly, for every kind of event the guard writes."""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.events.definitions import EVENT_DECODER, EVENTS, LEVELS, fields_of

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

DOCS = Path(__file__).resolve().parent.parent / "docs" / "log-events.md"
COMMON = {"ts", "level", "event", "run", "rank"}


def _table() -> dict[str, tuple[str, str]]:
    """``{event: (level, fields cell)}`` of the docs' table."""
    rows: dict[str, tuple[str, str]] = {}
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = (cells[1], "|".join(cells[2:]))
    return rows


def test_the_docs_table_lists_every_definition_with_its_level_and_fields() -> None:
    """Same names, same levels; every field of a definition is named in its row, and every name a row gives as a
    field (a backticked identifier another definition has as a field) is one of this definition's."""
    table = _table()
    assert set(table) == set(EVENTS)
    all_fields = {field for cls in EVENTS.values() for field in fields_of(cls)}
    for name, cls in EVENTS.items():
        level, cell = table[name]
        assert level == LEVELS[name], name
        named = set(re.findall(r"`([a-z_]+)(?::[^`]*)?`", cell))
        missing = set(fields_of(cls)) - named
        assert not missing, f"{name}: fields not in docs/log-events.md: {sorted(missing)}"
        extra = {word for word in named & all_fields if word not in fields_of(cls)} - _MENTIONED.get(name, set())
        assert not extra, f"{name}: docs/log-events.md names fields its definition lacks: {sorted(extra)}"


_MENTIONED = {
    # Words of a row that are another event's fields but name something else there.
    "halt": {"recovery", "scaler_skip"},
    "rewind": {"counters", "rewind", "recovery"},
    "attach": {"snapshot_bytes"},
    "nonfinite": {"recovery"},
    "scaler_skip": {"halt", "rewind"},
    "spike_skip": {"scope"},
    "detach": {"removed"},
    "vanishing": {"recovered"},
    "exploding": {"recovered"},
    "recovered": {"vanishing", "exploding"},
}


# --- real runs that make every kind happen --------------------------------------------------------------------


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + self.c(x) + self.d(x) + 0.0 * self.frozen(x)


def _rule(name: str, match: str, *actions: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "match": match, "actions": list(actions)}


def _loop(
    log: Path,
    rules: list[dict[str, Any]],
    *,
    steps: int = 30,
    nan_at: tuple[int, ...] = (),
    spike_at: tuple[int, ...] = (),
    recovery: dict[str, Any] | None = None,
    fp16: bool = False,
    loss: dict[str, Any] | None = None,
    loss_nan_at: tuple[int, ...] = (),
    vector_backward_at: tuple[int, ...] = (),
) -> None:
    torch.manual_seed(0)
    model = Wide()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if fp16 else None
    data: dict[str, Any] = {"version": 1, "rules": rules}
    if recovery is not None:
        data["recovery"] = recovery
    if loss is not None:
        data["loss"] = loss
    with GradGuard(model, Policy.from_dict(data), logger=None, audit_log=log, summary_every=10, scaler=scaler):
        try:
            for step in range(steps):
                x = torch.randn(4, 4) * (1000.0 if step in spike_at else 1.0 + (step % 3))
                if step in nan_at:
                    x[0, 0] = float("nan")
                optimizer.zero_grad()
                if step in vector_backward_at:
                    model(x).backward(torch.ones(4, 4))
                    optimizer.step()
                elif scaler is None:
                    value = model(x).pow(2).mean()
                    (value + float("nan") if step in loss_nan_at else value).backward()
                    optimizer.step()
                else:
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(x)
                    scaler.scale(out.float().pow(2).mean()).backward()
                    scaler.step(optimizer)
                    scaler.update()
        except GradientHalt:
            pass


def _reruns(closures: Path, plain: Path) -> None:
    """A transient NaN in a closure step (``rerun``), and one in a plain loop (``rerun_unavailable``)."""
    rules = [_rule("halt", "*", {"action": "halt_on_nonfinite"})]
    policy = Policy.from_dict({"version": 1, "rules": rules, "rerun": {}})
    for log, closure in ((closures, True), (plain, False)):
        torch.manual_seed(0)
        model = Wide()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        with GradGuard(model, policy, logger=None, audit_log=log):
            for step in range(4):
                calls = [0]

                def compute(
                    step: int = step,
                    calls: list[int] = calls,
                    model: nn.Module = model,
                    optimizer: torch.optim.Optimizer = optimizer,
                ) -> torch.Tensor:
                    calls[0] += 1
                    optimizer.zero_grad()
                    loss = model(torch.randn(4, 4)).pow(2).mean()
                    loss = loss * float("nan") if step == 2 and calls[0] == 1 else loss
                    loss.backward()
                    return loss

                try:
                    if closure:
                        optimizer.step(compute)
                    else:
                        compute()
                        optimizer.step()
                except GradientHalt:
                    break


def _every_kind(tmp_path: Path) -> list[Path]:
    logs = []

    def log(name: str) -> Path:
        logs.append(tmp_path / f"{name}.jsonl")
        return logs[-1]

    skip = _rule("skip", "*", {"action": "skip_step_on_nonfinite"})
    _loop(
        log("actions"),
        [
            skip,
            _rule("spikes", "a.*", {"action": "skip_step_on_spike", "window": 8, "min_samples": 4, "z_thresh": 3.0}),
            _rule("clip", "a.*", {"action": "clip_norm", "max_norm": 0.5}),
            _rule("group", "b.*", {"action": "clip_norm", "max_norm": 0.5, "scope": "group"}),
            _rule("values", "c.weight", {"action": "clip_value", "limit": 0.01}),
            _rule("zclip", "c.*", {"action": "zclip", "warmup_steps": 3, "z_thresh": 0.5}),
            _rule("zgroup", "d.*", {"action": "zclip", "warmup_steps": 3, "z_thresh": 0.5, "scope": "group"}),
            _rule("auto", "b.*", {"action": "autoclip", "history": 6, "percentile": 10.0}),
            _rule("agc", "d.*", {"action": "agc", "clipping": 0.001}),
            _rule("agc-group", "c.*", {"action": "agc", "clipping": 0.001, "scope": "group"}),
            _rule(
                "health",
                "*",
                {"action": "monitor", "stats": ["norm", "max_abs"], "vanishing_below": 1e-9, "exploding_above": 50.0},
            ),
            _rule("joint", "*", {"action": "monitor", "stats": ["norm"], "scope": "group", "every": 5}),
        ],
        nan_at=(20,),
        spike_at=(12, 25),
    )
    _loop(
        log("unhalted"), [_rule("group", "*", {"action": "clip_norm", "max_norm": 0.5, "scope": "group"})], nan_at=(5,)
    )
    _loop(log("halt"), [_rule("halt", "*", {"action": "halt_on_nonfinite"})], nan_at=(5,))
    _reruns(log("rerun"), log("rerun-unavailable"))
    _loop(
        log("loss"),
        [_rule("health", "*", {"action": "monitor", "stats": ["norm"], "every": 5})],
        loss={"nonfinite": "skip", "spike": {"factor": 10, "window": 8, "warmup": 4}},
        spike_at=(12,),
        loss_nan_at=(15,),
        vector_backward_at=(18,),
    )
    recovery = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}
    _loop(log("rewind"), [_rule("halt", "*", {"action": "halt_on_nonfinite"})], nan_at=(12,), recovery=recovery)
    _loop(
        log("scaler"),
        [_rule("halt", "*", {"action": "halt_on_nonfinite", "max_scaler_skips": 2})],
        nan_at=(3, 4, 5, 6, 7),
        fp16=True,
    )

    # A float32 norm that overflows on finite gradients.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                _rule("halt", "*", {"action": "halt_on_nonfinite"}),
                _rule("clip", "*", {"action": "clip_norm", "max_norm": 1.0}),
            ],
        }
    )
    with GradGuard(model, policy, logger=None, audit_log=log("overflow")) as guard:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[0].weight.grad.fill_(1e20)
        guard.step()

    # Parameters replaced under an explicit optimizer, then a new optimizer steps them.
    linear = nn.Linear(4, 2)
    opt = torch.optim.SGD(linear.parameters(), lr=1.0)
    policy = Policy.from_dict({"version": 1, "rules": [_rule("scale", "*", {"action": "scale", "factor": 0.5})]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradGuard(linear, policy, optimizer=opt, logger=None, audit_log=log("rebind")):
            linear.load_state_dict({k: v.clone() for k, v in linear.state_dict().items()}, assign=True)
            new_opt = torch.optim.SGD(linear.parameters(), lr=1.0)
            linear(torch.randn(3, 4)).sum().backward()
            new_opt.step()

    # A policy reloaded from its file, then a broken file; a guard resumed from a state_dict.
    first, second, broken = tmp_path / "p.json", tmp_path / "q.json", tmp_path / "broken.json"
    first.write_text(
        json.dumps({"version": 1, "rules": [_rule("clip", "*", {"action": "clip_norm", "max_norm": 1.0})]})
    )
    second.write_text(
        json.dumps({"version": 1, "rules": [_rule("clip", "*", {"action": "clip_norm", "max_norm": 0.1})]})
    )
    broken.write_text("{not json")
    linear = nn.Linear(4, 2)
    opt = torch.optim.SGD(linear.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradGuard(linear, first, logger=None, audit_log=log("reload")) as guard:
            for step in range(3):
                opt.zero_grad()
                linear(torch.randn(3, 4) * 10).sum().backward()
                opt.step()
                if step == 0:
                    assert guard.reload(second)
                elif step == 1:
                    assert not guard.reload(broken)
            state = guard.state_dict()
        with GradGuard(linear, second, logger=None, audit_log=log("resumed")) as resumed:
            resumed.load_state_dict(state)
    _resumed_without_state(log("state-missing"), tmp_path)
    _snapshots_placed(log("snapshot-placement"), log("snapshot-fallback"))
    return logs


def _snapshots_placed(placed: Path, fallen_back: Path) -> None:
    """``memory: auto`` decided from a (faked) measured peak, and a device allocation that fails (faked)."""
    from gradguard.enforce.recovery import snapshot_memory

    recovery = {"snapshot_every": 2, "min_age": 1}
    halt = _rule("halt", "*", {"action": "halt_on_nonfinite"})
    figures, peak, empty = snapshot_memory.device_memory, snapshot_memory.measured_peak, snapshot_memory.Placement.empty

    def full(self: snapshot_memory.Placement, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.where == "device":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")
        return empty(self, numel, dtype, device)

    try:
        snapshot_memory.device_memory = lambda device: (2**30, 2**31)  # type: ignore[assignment]
        snapshot_memory.measured_peak = lambda device: (2**31 - 2**20, 2**20)  # type: ignore[assignment]
        _loop(placed, [halt], steps=4, recovery=recovery)
    finally:
        snapshot_memory.device_memory, snapshot_memory.measured_peak = figures, peak  # type: ignore[assignment]
    try:
        snapshot_memory.Placement.empty = full  # type: ignore[method-assign]
        _loop(fallen_back, [halt], steps=4, recovery={**recovery, "memory": "device"})
    finally:
        snapshot_memory.Placement.empty = empty  # type: ignore[method-assign]


def _resumed_without_state(audit: Path, tmp_path: Path) -> None:
    """The Hugging Face callback starting a run the Trainer resumed at step 3 from a checkpoint with no guard state."""
    if not HAS_TRANSFORMERS:
        return
    import transformers

    from gradguard.integrations.transformers import GradGuardCallback

    callback = GradGuardCallback(
        Policy.from_dict({"version": 1, "rules": [_rule("halt", "*", {"action": "halt_on_nonfinite"})]}),
        logger=None,
        audit_log=audit,
    )
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback.on_train_begin(
            args, transformers.TrainerState(global_step=3), transformers.TrainerControl(), model=nn.Linear(4, 2)
        )
    callback.remove()


@pytest.fixture(scope="module")
def real_lines(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, int, str]]:
    logs = _every_kind(tmp_path_factory.mktemp("every-kind"))
    return [(log.name, number, line) for log in logs for number, line in enumerate(log.read_text().splitlines(), 1)]


def test_real_runs_write_every_kind_of_event(real_lines: list[tuple[str, int, str]]) -> None:
    """The runs above make every event the guard writes happen at least once."""
    seen = {json.loads(line)["event"] for _, _, line in real_lines}
    # Written only under torch.distributed: tests/test_which_rank.py's real gloo runs write them, and hold every line
    # they write to its definition there.
    seen |= {"rank_outlier", "replica_divergence", "rank_failure"}
    if not HAS_TRANSFORMERS:
        seen.add("state_missing")  # written by the Hugging Face callback only
    assert seen == set(EVENTS), (
        f"never written: {sorted(set(EVENTS) - seen)}; not defined: {sorted(seen - set(EVENTS))}"
    )


def test_every_line_of_a_real_run_fits_its_definition_exactly(real_lines: list[tuple[str, int, str]]) -> None:
    """Each line decodes into its typed event, at its definition's level, with no field the definition lacks."""
    problems = []
    for name, number, line in real_lines:
        where = f"{name}:{number}"
        try:
            event = EVENT_DECODER.decode(line)
        except Exception as exc:
            problems.append(f"{where}: {exc}: {line[:200]}")
            continue
        raw = json.loads(line)
        cls = type(event)
        undefined = set(raw) - COMMON - set(fields_of(cls))
        if undefined:
            problems.append(f"{where}: {raw['event']} fields without a definition: {sorted(undefined)}")
        if raw.get("level") != cls.LEVEL:
            problems.append(f"{where}: {raw['event']} written at {raw.get('level')}, defined at {cls.LEVEL}")
    assert not problems, "\n".join(problems[:20])
