"""recovery.memory: where snapshots live (device, host, auto), chosen at attach from the device's memory figures
(faked here: on the CPU every mode is a copy in memory), told by the attach event, metrics, explain and audit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GuardStateError, Policy, PolicyError
from gradguard.cli import main
from gradguard.enforce.recovery import snapshot_memory
from gradguard.enforce.recovery.snapshot_memory import MEMORY_MARGIN, Flat, Stager, choose_placement, state_to_come

HALT = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
GiB = 2**30
CPU = torch.device("cpu")


def policy(**recovery: Any) -> Policy:
    return Policy.from_dict({"version": 1, "rules": [HALT], "recovery": {"snapshot_every": 2, **recovery}})


def fake_device(monkeypatch: pytest.MonkeyPatch, free: int, total: int) -> None:
    """The device's memory figures, as torch.cuda.mem_get_info would give them."""
    monkeypatch.setattr(snapshot_memory, "device_memory", lambda device: (free, total))


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def run(model: nn.Module, opt: torch.optim.Optimizer, guard: GradGuard, steps: int, nan_at: int | None = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        (loss * float("nan") if step == nan_at else loss).backward()
        opt.step()


def attach_event(log: Path) -> dict[str, Any]:
    (event,) = [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == "attach"]
    return dict(event["recovery"])


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_an_unknown_memory_value_is_a_policy_error_naming_recovery_memory() -> None:
    with pytest.raises(PolicyError, match=r"recovery\.memory: got 'gpu'; expected 'device', 'host' or 'auto'"):
        policy(memory="gpu")
    default = policy().recovery
    assert default is not None
    assert default.memory == "auto"


def test_the_json_schema_offers_the_three_memory_modes_with_auto_as_default() -> None:
    schema = json.loads(CliRunner().invoke(main, ["schema"]).output)
    recovery = schema["$defs"]["Recovery"]["properties"]["memory"]
    assert recovery["enum"] == ["device", "host", "auto"]
    assert recovery["default"] == "auto"


def test_auto_keeps_snapshots_on_the_device_when_they_fit_with_the_margin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The attach event, and guard.metrics(), say where they live and how many bytes they hold."""
    fake_device(monkeypatch, free=40 * GiB, total=80 * GiB)
    model, opt = model_and_optimizer()
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), optimizer=opt, logger=None, audit_log=log) as guard:
        run(model, opt, guard, 6)
        metrics = guard.metrics()
    attach = attach_event(log)
    assert (attach["memory"], attach["where"], attach["staged"]) == ("auto", "device", False)
    assert attach["needed_bytes"] == 2 * 3 * param_bytes(model)  # keep 2 x (weights + AdamW's two moments to come)
    assert attach["free_bytes"] == 40 * GiB
    assert "they fit" in attach["why"]
    assert metrics["gradguard/recovery/device_bytes"] == metrics["gradguard/recovery/snapshot_bytes"] > 0
    assert metrics["gradguard/recovery/host_bytes"] == 0


def test_auto_falls_back_to_host_memory_staged_through_one_device_buffer_when_keep_does_not_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One snapshot's staging buffer fits where two snapshots do not: host memory, the copy beside the step."""
    model, opt = model_and_optimizer()
    per_snapshot = 3 * param_bytes(model)
    total = 1_000_000
    to_come = 3 * param_bytes(model)  # gradients and AdamW's moments, not made yet at attach
    fake_device(monkeypatch, free=int(total * MEMORY_MARGIN) + to_come + per_snapshot + 100, total=total)
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), optimizer=opt, logger=None, audit_log=log) as guard:
        run(model, opt, guard, 6)
        metrics = guard.metrics()
    attach = attach_event(log)
    assert (attach["where"], attach["staged"]) == ("host", True)
    assert "do not fit" in attach["why"]
    assert "side stream" in attach["why"]
    assert metrics["gradguard/recovery/host_bytes"] == metrics["gradguard/recovery/snapshot_bytes"] > 0
    assert metrics["gradguard/recovery/device_bytes"] == metrics["gradguard/recovery/snapshot_bytes"] / 2  # staging


def test_device_memory_asked_for_and_not_fitting_is_an_error_at_attach_naming_bytes_needed_and_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not an out-of-memory error in the middle of a run; no hook is left behind, and the model is free for another
    guard afterwards."""
    model, opt = model_and_optimizer()
    fake_device(monkeypatch, free=3 * param_bytes(model), total=10 * GiB)
    needed = 2 * 3 * param_bytes(model)
    with pytest.raises(GuardStateError) as caught:
        GradGuard(model, policy(memory="device"), optimizer=opt, logger=None, provenance="always")
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    message = str(caught.value)
    assert "recovery.memory is 'device'" in message
    assert f"2 snapshots need {needed / 1024:.3g} KiB ({needed:,} bytes) on cpu" in message
    assert f"which has {3 * param_bytes(model) / 1024:.3g} KiB ({3 * param_bytes(model):,} bytes) free" in message
    assert "memory: host" in message
    GradGuard(model, policy(memory="host"), optimizer=opt, logger=None).remove()


def test_device_memory_that_fits_without_the_margin_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The margin is auto's caution; device asked for needs only the bytes themselves."""
    model, opt = model_and_optimizer()
    to_come = 3 * param_bytes(model)  # gradients and AdamW's moments, not made yet at attach
    fake_device(monkeypatch, free=2 * 3 * param_bytes(model) + to_come, total=10 * GiB)
    with GradGuard(model, policy(memory="device"), optimizer=opt, logger=None) as guard:
        placement = guard._enforcer.recovery.placement
        assert placement is not None
        assert placement.where == "device"
    with GradGuard(model, policy(memory="auto"), optimizer=opt, logger=None) as guard:
        placement = guard._enforcer.recovery.placement
        assert placement is not None
        assert placement.where == "host"


def test_auto_leaves_a_quarter_of_the_devices_memory_for_activations() -> None:
    """keep x snapshot + what the run will still allocate + 25% of the total must fit in the free memory."""
    gib = 2**30
    for free, where in ((20 * gib + 5 * gib + 20 * gib, "device"), (20 * gib + 5 * gib + 20 * gib - 1, "host")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(snapshot_memory, "device_memory", lambda device, free=free: (free, 80 * gib))
            chosen = choose_placement("auto", torch.device("cuda", 0), 2, 10 * gib, 5 * gib)
        assert chosen.where == where, free


def test_host_memory_without_room_for_a_staging_buffer_copies_directly_and_says_the_step_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_device(monkeypatch, free=0, total=80 * GiB)
    chosen = choose_placement("host", torch.device("cuda", 0), 2, GiB, 0)
    assert (chosen.where, chosen.staged) == ("host", False)
    assert "the step waits for the copy" in chosen.why


def test_on_the_cpu_every_mode_is_a_copy_in_memory_and_auto_keeps_it_beside_the_parameters() -> None:
    for memory, where in (("device", "device"), ("host", "host"), ("auto", "device")):
        chosen = choose_placement(memory, CPU, 2, 1000, 0)
        assert (chosen.where, chosen.staged) == (where, False)
        assert "on the CPU every snapshot is a copy in memory" in chosen.why


def test_the_optimizer_state_still_to_come_is_counted_by_the_optimizers_kind() -> None:
    params = [nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(5))]
    assert state_to_come([torch.optim.AdamW(params)], params) == 2 * 60
    assert state_to_come([torch.optim.Adam(params, amsgrad=True)], params) == 3 * 60
    assert state_to_come([torch.optim.SGD(params, lr=0.1)], params) == 0
    assert state_to_come([torch.optim.SGD(params, lr=0.1, momentum=0.9)], params) == 60
    assert state_to_come(None, params) == 2 * 60  # not given: Adam's two moments assumed


def test_a_fault_right_after_a_staged_snapshot_rewinds_to_it_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host memory through the staging buffer: the rewind reads the host copy (complete on the CPU; on CUDA the
    restore waits for its event on the device) and the run ends as the one that never saw the undone batches."""
    fake_device(monkeypatch, free=80 * GiB, total=80 * GiB)

    def train(nan_at: int | None, skip: range | None) -> nn.Module:
        model, opt = model_and_optimizer()
        recovery = {"memory": "host", "min_age": 0, "skip_steps": 0}
        with GradGuard(model, policy(**recovery), optimizer=opt, logger=None) as guard:
            gen = torch.Generator().manual_seed(1)
            for step in range(10):
                x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
                if skip is not None and step in skip:
                    continue
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                (loss * float("nan") if step == nan_at else loss).backward()
                opt.step()
            placement = guard._enforcer.recovery.placement
            assert placement is not None
            assert placement.staged
        return model

    got, want = train(4, None), train(None, range(4, 5))
    assert all(torch.equal(a, b) for a, b in zip(got.parameters(), want.parameters(), strict=True))


def test_a_stager_copies_every_queued_list_into_its_host_buffers_in_few_large_copies() -> None:
    sources = [torch.randn(3, 4), torch.arange(5), torch.randn(7, dtype=torch.float64), torch.randn(2)]
    host = Flat(sources, "host", lambda n, dtype, device: torch.full((n,), -1, dtype=dtype))
    more = [torch.randn(1)]
    host_more = Flat(more, "host", lambda n, dtype, device: torch.empty(n, dtype=dtype))
    stager = Stager(CPU)
    stager.add(host, sources)
    stager.add(host_more, more)
    assert stager.flush() is None  # off CUDA the copy is complete when flush returns
    assert len(host.storage) == 3  # float32, int64, float64: one buffer each
    assert all(torch.equal(view, source) for view, source in zip(host.views, sources, strict=True))
    assert torch.equal(host_more.views[0], more[0])
    assert stager.nbytes == sum(s.numel() * s.element_size() for s in [*sources, *more])


def test_a_reload_that_changes_memory_moves_the_snapshots_at_the_next_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_device(monkeypatch, free=80 * GiB, total=80 * GiB)
    path = tmp_path / "policy.json"
    document = {"version": 1, "rules": [HALT], "recovery": {"snapshot_every": 2, "memory": "device"}}
    path.write_text(json.dumps(document))
    model, opt = model_and_optimizer()
    with GradGuard(model, path, optimizer=opt, logger=None) as guard:
        run(model, opt, guard, 3)
        assert guard.metrics()["gradguard/recovery/host_bytes"] == 0
        path.write_text(json.dumps({**document, "recovery": {"snapshot_every": 2, "memory": "host"}}))
        assert guard.reload()
        run(model, opt, guard, 3)
        metrics = guard.metrics()
    assert metrics["gradguard/recovery/device_bytes"] > 0  # the staging buffer
    assert metrics["gradguard/recovery/host_bytes"] > 0


def test_explain_says_where_snapshots_live_and_their_bytes(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"version": 1, "rules": [HALT], "recovery": {"snapshot_every": 5, "memory": "host"}}))
    (tmp_path / "models.py").write_text("from torch import nn\n\n\ndef build():\n    return nn.Linear(4, 2)\n")
    spec = f"{tmp_path / 'models.py'}:build"
    result = CliRunner().invoke(main, ["explain", str(path), "--model", spec])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    per_snapshot = 10 * 4 + 2 * 10 * 4 + 2 * 4  # weights, AdamW's moments, a step per tensor
    assert f"memory: host: pinned host memory ({2 * per_snapshot} bytes for 2)" in text
    assert f"staged through one device buffer ({per_snapshot} bytes)" in text
    result = CliRunner().invoke(main, ["explain", str(path), "--model", spec, "--format", "json"])
    assert json.loads(result.output)["recovery"]["where"].startswith("host")


def test_audit_says_where_the_snapshots_lived(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_device(monkeypatch, free=80 * GiB, total=80 * GiB)
    model, opt = model_and_optimizer()
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(memory="auto"), optimizer=opt, logger=None, audit_log=log) as guard:
        run(model, opt, guard, 4)
    result = CliRunner().invoke(main, ["audit", str(log)])
    assert result.exit_code == 0, result.output
    needed = 2 * 3 * param_bytes(model)
    told = f"recovery snapshots in device memory (cpu, memory: auto), {needed:,} bytes for 2 snapshots"
    assert told in " ".join(result.output.split())


def events_named(log: Path, name: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == name]


def fake_peak(monkeypatch: pytest.MonkeyPatch, peak: int, allocated: int) -> None:
    """What torch's allocator would say the run has used at most, and uses now."""
    monkeypatch.setattr(snapshot_memory, "measured_peak", lambda device: (peak, allocated))


def test_auto_moves_snapshots_to_the_host_when_the_runs_measured_peak_leaves_no_room_for_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The free memory at attach would take them, but the first step's activations showed it would not."""
    fake_device(monkeypatch, free=40 * GiB, total=80 * GiB)
    fake_peak(monkeypatch, peak=79 * GiB, allocated=10 * GiB)
    model, opt = model_and_optimizer()
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), optimizer=opt, logger=None, audit_log=log) as guard:
        run(model, opt, guard, 6)
        metrics = guard.metrics()
    attach = attach_event(log)
    assert attach["where"] == "device"
    assert "provisional" in attach["why"]
    (placed,) = events_named(log, "snapshot_placement")
    assert (placed["level"], placed["step"], placed["where"], placed["staged"]) == ("info", 0, "host", False)
    assert "measured peak of 79 GiB" in placed["why"]
    assert "do not fit" in placed["why"]
    assert metrics["gradguard/recovery/host_bytes"] == metrics["gradguard/recovery/snapshot_bytes"] > 0
    assert metrics["gradguard/recovery/device_bytes"] == 0


def test_auto_keeps_snapshots_on_the_device_when_the_runs_measured_peak_leaves_room_beyond_any_margin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """At attach the fixed margin said host; the run's peak shows they fit: the device, from the first snapshot."""
    model, opt = model_and_optimizer()
    total = 1_000_000
    fake_device(monkeypatch, free=int(total * MEMORY_MARGIN) // 2, total=total)
    fake_peak(monkeypatch, peak=total // 2, allocated=total // 4)
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), optimizer=opt, logger=None, audit_log=log) as guard:
        run(model, opt, guard, 6)
        metrics = guard.metrics()
    assert attach_event(log)["where"] == "host"
    (placed,) = events_named(log, "snapshot_placement")
    assert (placed["where"], placed["staged"]) == ("device", False)
    assert "they fit" in placed["why"]
    assert metrics["gradguard/recovery/device_bytes"] == metrics["gradguard/recovery/snapshot_bytes"] > 0


@pytest.mark.parametrize("memory", ["device", "auto"])
def test_a_snapshot_that_cannot_be_allocated_on_the_device_goes_to_the_host_and_the_run_rewinds_all_the_same(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, memory: str
) -> None:
    """An allocation failure for a snapshot never ends the run: said once, and the rewind is as exact as the host's."""

    def twin(fail: bool) -> tuple[nn.Module, GradGuard, Path]:
        model, opt = model_and_optimizer()
        log = tmp_path / f"{memory}-{fail}.jsonl"
        chosen = memory if fail else "host"
        with GradGuard(model, policy(memory=chosen, keep=2, min_age=1), optimizer=opt, logger=None, audit_log=log) as g:
            run(model, opt, g, 10, nan_at=7)
        return model, g, log

    original = snapshot_memory.Placement.empty
    failures = []

    def device_full(self: snapshot_memory.Placement, numel: int, dtype: torch.dtype, device: torch.device) -> Any:
        if self.where == "device":
            failures.append(numel)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {numel * 4} bytes")
        return original(self, numel, dtype, device)

    monkeypatch.setattr(snapshot_memory.Placement, "empty", device_full)
    got, guard, log = twin(fail=True)
    assert failures
    monkeypatch.setattr(snapshot_memory.Placement, "empty", original)
    want, reference, _ = twin(fail=False)
    assert guard.counters.snapshot() == reference.counters.snapshot()
    assert guard.counters.snapshot()["nonfinite"]["rewind"] == 1
    for p, q in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q)
    (placed,) = events_named(log, "snapshot_fallback")
    assert (placed["level"], placed["where"], placed["staged"]) == ("warning", "host", False)
    assert "allocating a snapshot on cpu failed (CUDA out of memory. Tried to allocate" in placed["why"]
    assert "the run goes on" in placed["why"]
