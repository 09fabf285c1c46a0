"""Parameter identity: tied weights, parameters replaced after attach, a second guard on one model,
sparse and complex parameters, and wrappers (FSDP1, DeepSpeed) whose parameters cannot be matched.

Where the guard trains, it is compared with an unguarded reference that applies the policy by hand.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.training import SmallMLP, assert_same_params, events_of, make_policy
from torch import nn

from gradguard import GradGuard, GradientHalt, GuardStateError, GuardWarning, Policy, PolicyError
from gradguard.cli.demo import TinyDecoder


def decoder(seed: int = 0) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(vocab=16, width=16, depth=1, heads=2, context=8)


def decoder_backward(model: nn.Module, step: int) -> None:
    tokens = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(4000 + step))
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, 16), tokens[:, 1:].reshape(-1)).backward()


def mlp_backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(5000 + step)
    x, y = torch.randn(16, 8, generator=gen) * 3, torch.randn(16, 4, generator=gen)
    (nn.functional.mse_loss(model(x), y) * 10).backward()


# --- tied parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["head.weight", "embed.weight", ["head.*", "embed.*"]], ids=str)
def test_a_tied_parameter_is_matched_under_every_name_and_treated_once(pattern: Any) -> None:
    """TinyDecoder ties head.weight to embed.weight: a scale 0.5 matched through either name (or both) is applied
    once per step (x0.5, never x0.25), and counted once, exactly as a reference that scales it once by hand."""
    model = decoder()
    ref = copy.deepcopy(model)
    assert model.head.weight is model.embed.weight
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    policy = make_policy({"match": pattern, "actions": [{"action": "scale", "factor": 0.5}]})
    with GradGuard(model, policy, logger=None) as guard:
        assert guard.guarded == {"embed.weight": ("r0",)}
        for step in range(3):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                decoder_backward(m, step)
            ref.embed.weight.grad.mul_(0.5)
            opt_r.step()
            opt_g.step()
            assert torch.equal(model.embed.weight.grad, ref.embed.weight.grad), f"step {step}"
            assert_same_params(model, ref, f"step {step}")
        assert guard.counters.snapshot() == {"r0": {"scale": 3}}


def test_a_tied_parameter_in_a_group_clip_counts_once_in_the_joint_norm() -> None:
    """A group clip over '*' sees the tied tensor once, as clip_grad_norm_(model.parameters()) does."""
    model = decoder(1)
    ref = copy.deepcopy(model)
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.1, "scope": "group"}]})
    with GradGuard(model, policy, logger=None) as guard:
        for m in (model, ref):
            decoder_backward(m, 0)
        guard.step()
        n_params = len(list(model.parameters()))
        assert guard.counters.snapshot() == {"r0": {"clip_norm": n_params}}
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_two_rules_changing_a_tied_tensor_through_its_two_names_are_a_policy_error_naming_both() -> None:
    """scale via embed.weight and clip via head.weight: most likely meant as two tensors; refused."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "embeddings", "match": "embed.weight", "actions": [{"action": "scale", "factor": 0.5}]},
                {"name": "output-head", "match": "head.weight", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
            ],
        }
    )
    model = decoder()
    with pytest.raises(PolicyError) as info:
        GradGuard(model, policy, logger=None)
    message = str(info.value)
    for expected in ("embeddings", "output-head", "embed.weight", "head.weight", "tied"):
        assert expected in message
    assert isinstance(info.value, ValueError)


def test_drop_or_zero_with_another_gradient_change_on_one_tensor_is_a_policy_error_naming_both_rules() -> None:
    """drop in one rule and scale in another, on the same tensor: the scale would be void; refused."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "freeze-out", "match": "out.*", "actions": [{"action": "drop"}]},
                {"name": "slow-everything", "match": "*", "actions": [{"action": "scale", "factor": 0.1}]},
            ],
        }
    )
    with pytest.raises(PolicyError) as info:
        GradGuard(SmallMLP(hidden=False), policy, logger=None)
    message = str(info.value)
    assert "freeze-out" in message
    assert "slow-everything" in message
    assert "out.weight" in message
    assert "inp.weight" not in message, "only the tensors both rules change are named"


def test_rules_whose_step_windows_never_overlap_do_not_conflict() -> None:
    """'Freeze for 5 steps, then train slowly': zero on [0, 5) and scale from 5 never act on one step; both
    apply, each in its window, as by hand."""
    policy = make_policy(
        {"name": "frozen-warmup", "match": "*", "until_step": 5, "actions": [{"action": "zero"}]},
        {"name": "slow-after", "match": "*", "from_step": 5, "actions": [{"action": "scale", "factor": 0.1}]},
    )
    torch.manual_seed(9)
    model = SmallMLP(hidden=False)
    ref = copy.deepcopy(model)
    with GradGuard(model, policy, logger=None) as guard:
        assert guard.guarded["inp.weight"] == ("frozen-warmup", "slow-after")
        for step in range(7):
            for m in (model, ref):
                m.zero_grad()
                mlp_backward(m, step)
            for p in ref.parameters():
                if step < 5:
                    p.grad.zero_()
                else:
                    p.grad.mul_(0.1)
            guard.step()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), f"step {step}"
        assert guard.counters.snapshot() == {"frozen-warmup": {"zero": 4 * 5}, "slow-after": {"scale": 4 * 2}}


def test_rules_whose_step_windows_overlap_still_conflict() -> None:
    """zero on [0, 5) and scale from 3: on steps 3 and 4 the scale would be void; refused, naming both."""
    policy = make_policy(
        {"name": "frozen-warmup", "match": "*", "until_step": 5, "actions": [{"action": "zero"}]},
        {"name": "slow-after", "match": "*", "from_step": 3, "actions": [{"action": "scale", "factor": 0.1}]},
    )
    with pytest.raises(PolicyError, match=r"frozen-warmup.*slow-after"):
        GradGuard(SmallMLP(hidden=False), policy, logger=None)


def test_a_watching_rule_and_a_changing_rule_on_a_tied_tensor_do_not_conflict() -> None:
    """halt_on_nonfinite via head.weight and a clip via embed.weight: only one of them changes the gradient."""
    model = decoder()
    policy = make_policy(
        {"match": "head.weight", "actions": [{"action": "halt_on_nonfinite"}]},
        {"match": "embed.weight", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        assert guard.guarded == {"embed.weight": ("r0", "r1")}
        decoder_backward(model, 0)
        model.embed.weight.grad[0, 0] = float("nan")
        with pytest.raises(GradientHalt) as info:
            guard.step()
    assert info.value.params == ("embed.weight",)


# --- parameters replaced after attach --------------------------------------------------------------------


def train_two_steps(model: nn.Module, ref: nn.Module) -> None:
    """Two steps with fresh SGD optimizers; the reference clips every tensor to 0.5 by hand."""
    opt_g = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        for m, opt in ((model, opt_g), (ref, opt_r)):
            opt.zero_grad()
            mlp_backward(m, step)
        for p in ref.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.5)
        opt_r.step()
        opt_g.step()
        assert_same_params(model, ref, f"step {step}")


CLIP = make_policy({"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]})


def replace_by_load_state_dict_assign(model: nn.Module) -> None:
    model.load_state_dict({k: v.clone() * 2 for k, v in model.state_dict().items()}, assign=True)


def replace_by_setattr(model: nn.Module) -> None:
    model.out.weight = nn.Parameter(model.out.weight.detach().clone() * 2)


REPLACEMENTS = {"load_state_dict(assign=True)": replace_by_load_state_dict_assign, "setattr": replace_by_setattr}


@pytest.mark.parametrize("how", sorted(REPLACEMENTS))
def test_a_parameter_replaced_after_attach_is_rebound_and_the_rebind_is_logged(how: str, tmp_path: Path) -> None:
    """After load_state_dict(assign=True) or module.weight = nn.Parameter(...), a new optimizer's step applies
    the policy to the new tensors (as the reference by hand), and a 'rebind' warning names the replaced ones."""
    torch.manual_seed(0)
    model = SmallMLP(hidden=False)
    log = tmp_path / "audit.jsonl"
    with GradGuard(model, CLIP, logger=None, audit_log=log) as guard:
        old_ids = {name: id(p) for name, p in model.named_parameters()}
        REPLACEMENTS[how](model)
        replaced = sorted(name for name, p in model.named_parameters() if id(p) != old_ids[name])
        assert replaced, "precondition: the parameters really are new tensors"
        ref = copy.deepcopy(model)
        train_two_steps(model, ref)
        assert guard.step_count == 2
        assert guard.counters.total("clip_norm") > 0
    (rebind,) = events_of(log, "rebind")
    assert rebind["level"] == "warning"
    assert sorted(rebind["replaced"]) == replaced
    assert rebind["step"] == 0


def test_a_model_built_on_meta_and_materialised_with_to_empty_is_guarded_after_it() -> None:
    """Attach on the meta device, then to_empty(device='cpu') and initialise: the real tensors are guarded."""
    with torch.device("meta"):
        model = SmallMLP(hidden=False)
    with GradGuard(model, CLIP, logger=None) as guard:
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        for module in (model.inp, model.out):
            module.reset_parameters()
        ref = copy.deepcopy(model)
        train_two_steps(model, ref)
        assert guard.step_count == 2
        assert guard.counters.total("clip_norm") > 0


def test_guard_step_notices_replaced_parameters_in_a_loop_without_an_optimizer() -> None:
    """guard.step() rebinds too: the new tensor's gradient is clipped, as by hand."""
    torch.manual_seed(2)
    model = SmallMLP(hidden=False)
    with GradGuard(model, CLIP, logger=None) as guard:
        replace_by_setattr(model)
        ref = copy.deepcopy(model)
        for m in (model, ref):
            mlp_backward(m, 0)
        assert guard.step() is True
        for p in ref.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        assert guard.counters.snapshot() == {"clip": {"clip_norm": 4}}


def test_a_replaced_parameter_that_got_the_old_ones_id_is_still_guarded(tmp_path: Path) -> None:
    """del module.weight, then a new Parameter: CPython often gives it the freed one's id. The guard matches by
    identity, not id, so the new weight is rebound and guarded (scale 0.0 keeps it still)."""
    torch.manual_seed(7)
    model = nn.Linear(4, 2)
    log = tmp_path / "audit.jsonl"
    policy = make_policy({"match": "weight", "actions": [{"action": "scale", "factor": 0.0}]})
    with GradGuard(model, policy, logger=None, audit_log=log) as guard:
        new_value = torch.randn(2, 4)
        del model.weight  # re-initialising a layer: the old Parameter is freed first
        model.weight = nn.Parameter(new_value)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = model.weight.detach().clone()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        assert torch.equal(model.weight, before), "scale 0.0 keeps the new weight still"
        assert guard.counters.snapshot() == {"r0": {"scale": 1}}
    assert len(events_of(log, "rebind")) == 1


def test_replacing_parameters_under_an_explicit_optimizer_is_never_silently_unguarded(tmp_path: Path) -> None:
    """optimizer=opt, then load_state_dict(assign=True) and a new optimizer (a checkpoint load): the new
    optimizer's step is still guarded, with a GuardWarning, an unexpected_optimizer and a rebind event."""
    torch.manual_seed(8)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    log = tmp_path / "audit.jsonl"
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.0}]})
    with GradGuard(model, policy, optimizer=opt, logger=None, audit_log=log) as guard:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        new_opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        model(torch.randn(3, 4)).sum().backward()
        with pytest.warns(GuardWarning, match="not given as optimizer="):
            new_opt.step()
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
        assert guard.counters.snapshot() == {"r0": {"scale": 2}}
    assert [sorted(event["replaced"]) for event in events_of(log, "rebind")] == [["bias", "weight"]]
    assert [event["optimizer"] for event in events_of(log, "unexpected_optimizer")] == ["SGD"]


# --- a second guard ------------------------------------------------------------------------------------


def test_a_second_guard_on_the_same_model_raises_a_clear_error_and_never_stacks() -> None:
    """Attaching twice (a notebook cell run again) raises GuardStateError; the first guard still acts once."""
    torch.manual_seed(3)
    model = SmallMLP(hidden=False)
    ref = copy.deepcopy(model)
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    with GradGuard(model, policy, logger=None) as first:
        with pytest.raises(GuardStateError, match=r"already has a GradGuard attached.*replace=True"):
            GradGuard(model, policy, logger=None)
        with pytest.raises(GuardStateError, match="already has a GradGuard attached"):
            GradGuard(torch.compile(model, backend="eager"), policy, logger=None)  # same tensors, another wrapper
        assert first.attached
        for m in (model, ref):
            mlp_backward(m, 0)
        first.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 0.5), "scaled once, not twice"


def test_a_second_guard_with_a_disjoint_policy_on_the_same_model_is_refused_too() -> None:
    """The first guard covers inp.*, the second out.*: still one model, so still GuardStateError."""
    model = SmallMLP(hidden=False)
    second_policy = make_policy({"match": "out.*", "actions": [{"action": "scale", "factor": 0.5}]})
    with (
        GradGuard(model, make_policy({"match": "inp.*", "actions": [{"action": "scale", "factor": 0.5}]}), logger=None),
        pytest.raises(GuardStateError, match="already has a GradGuard"),
    ):
        GradGuard(model, second_policy, logger=None)


def test_replace_true_removes_the_first_guard_and_attaches_the_new_one() -> None:
    """replace=True: the old guard is detached, the new policy alone applies."""
    torch.manual_seed(4)
    model = SmallMLP(hidden=False)
    ref = copy.deepcopy(model)
    first = GradGuard(model, make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.5}]}), logger=None)
    second_policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.25}]})
    with GradGuard(model, second_policy, logger=None, replace=True) as second:
        assert not first.attached
        assert second.attached
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for m in (model, ref):
            mlp_backward(m, 0)
        opt.step()
        assert first.step_count == 0
        assert second.counters.snapshot() == {"r0": {"scale": 4}}
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 0.25)


# --- sparse and complex parameters ---------------------------------------------------------------------


class SparseModel(nn.Module):
    def __init__(self, bag: bool = False) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(16, 8, sparse=True) if bag else nn.Embedding(16, 8, sparse=True)
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x if x.dim() == 2 else x.mean(dim=1))  # type: ignore[no-any-return]


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize(
    "action",
    [
        {"action": "halt_on_nonfinite"},
        {"action": "clip_norm", "max_norm": 1.0},
        {"action": "clip_value", "limit": 0.1},
        {"action": "scale", "factor": 0.5},
        {"action": "skip_step_on_nonfinite"},
    ],
    ids=lambda action: action["action"],
)
def test_a_sparse_gradient_parameter_is_refused_at_attach_with_its_name(action: dict[str, Any], bag: bool) -> None:
    """nn.Embedding/EmbeddingBag(sparse=True) under any action: GuardStateError at attach, naming the parameter."""
    model = SparseModel(bag)
    with pytest.raises(GuardStateError) as info:
        GradGuard(model, make_policy({"name": "rule-x", "match": "*", "actions": [action]}), logger=None)
    message = str(info.value)
    assert "'embed.weight'" in message
    assert "sparse" in message
    assert "rule-x" in message


def test_a_sparse_parameter_left_out_of_the_policy_trains_while_the_rest_is_guarded() -> None:
    """Excluding the sparse embedding lets the guard attach; the sparse gradient is untouched, the head clipped."""
    torch.manual_seed(5)
    model = SparseModel()
    ref = copy.deepcopy(model)
    opt_g = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    policy = make_policy({"match": "*", "exclude": "embed.*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]})
    with GradGuard(model, policy, logger=None) as guard:
        assert list(guard.guarded) == ["head.weight", "head.bias"]
        tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))
        for m in (model, ref):
            m(tokens).pow(2).sum().backward()
        assert model.embed.weight.grad.is_sparse
        for p in ref.head.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.01)
        opt_r.step()
        opt_g.step()
        assert guard.counters.snapshot() == {"r0": {"clip_norm": 2}}
    assert_same_params(model, ref, "after one step")


class ComplexModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotation = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
        self.real = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.real((x.to(torch.complex64) @ self.rotation).abs())  # type: ignore[no-any-return]


def test_a_complex_parameter_under_clip_value_is_refused_at_attach_with_its_name() -> None:
    """clip_value cannot clamp complex numbers: GuardStateError naming the parameter and the rule."""
    policy = make_policy({"name": "clamp", "match": "*", "actions": [{"action": "clip_value", "limit": 1.0}]})
    with pytest.raises(GuardStateError) as info:
        GradGuard(ComplexModel(), policy, logger=None)
    message = str(info.value)
    assert "'rotation'" in message
    assert "complex" in message
    assert "'clamp'" in message


def test_a_complex_parameter_is_clipped_scaled_and_halted_correctly() -> None:
    """clip_norm (tensor and group) and scale on a complex gradient equal torch's functions by hand; NaN halts.

    The group clip is over one dtype: over mixed dtypes clip_grad_norm_ sums the per-dtype norms in its own
    order, which can differ in the last bit (a separate finding)."""
    torch.manual_seed(6)
    model = ComplexModel()
    ref = copy.deepcopy(model)
    opt_g = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {
            "match": "rotation",
            "actions": [{"action": "scale", "factor": 3.0}, {"action": "clip_norm", "max_norm": 0.2}],
        },
        {"match": "real.*", "actions": [{"action": "clip_norm", "max_norm": 0.5, "scope": "group"}]},
        {"match": "rotation", "actions": [{"action": "clip_norm", "max_norm": 0.1, "scope": "group"}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                m(x).pow(2).sum().backward()
            assert model.rotation.grad.is_complex()
            ref.rotation.grad.mul_(3.0)
            torch.nn.utils.clip_grad_norm_([ref.rotation], 0.2)
            torch.nn.utils.clip_grad_norm_(ref.real.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_([ref.rotation], 0.1)
            opt_r.step()
            opt_g.step()
            assert_same_params(model, ref, f"step {step}")
        assert guard.counters.snapshot()["r1"] == {"scale": 3, "clip_norm": 3}
        opt_g.zero_grad()
        model(torch.randn(2, 4)).pow(2).sum().backward()
        model.rotation.grad[0, 0] = complex(float("nan"), 0.0)
        with pytest.raises(GradientHalt) as info:
            opt_g.step()
        assert info.value.params == ("rotation",)
        assert info.value.kind == "nan"


def test_a_group_clip_over_mixed_dtypes_is_bitwise_clip_grad_norm() -> None:
    """complex64 and float32 in one group clip: the guard sums the per-dtype norms in torch's order, so the
    result is clip_grad_norm_'s to the bit (100 random cases)."""
    torch.manual_seed(10)
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.2, "scope": "group"}]})
    for case in range(100):
        model = nn.Module()
        model.p = nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
        model.q = nn.Parameter(torch.zeros(4))
        g_p = torch.randn(4, 4, dtype=torch.complex64) * torch.rand(()) * 100
        g_q = torch.randn(4) * 10
        with GradGuard(model, policy, logger=None) as guard:
            model.p.grad, model.q.grad = g_p.clone(), g_q.clone()
            guard.step()
        ref_p, ref_q = nn.Parameter(torch.zeros_like(g_p)), nn.Parameter(torch.zeros_like(g_q))
        ref_p.grad, ref_q.grad = g_p.clone(), g_q.clone()
        torch.nn.utils.clip_grad_norm_([ref_p, ref_q], 0.2)
        assert torch.equal(model.p.grad, ref_p.grad), case
        assert torch.equal(model.q.grad, ref_q.grad), case


class FunctionalSparse(nn.Module):
    """A sparse gradient the attach check cannot foresee: F.embedding(sparse=True) on a plain Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.table, sparse=True).sum()


def test_a_sparse_gradient_the_attach_check_could_not_foresee_is_refused_at_the_step_naming_the_parameter() -> None:
    """The step raises GuardStateError naming 'table' and its sparse layout, before the optimizer runs."""
    model = FunctionalSparse()
    before = model.table.detach().clone()
    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    with GradGuard(model, policy, logger=None):
        model(torch.tensor([1, 2])).backward()
        assert model.table.grad.is_sparse
        with pytest.raises(GuardStateError, match=r"'table'.*sparse"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.equal(model.table, before)


# --- wrappers whose parameters cannot be matched -------------------------------------------------------


def test_an_fsdp1_wrapped_model_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """FullyShardedDataParallel (FSDP1, single-rank gloo) flattens the parameters: GuardStateError pointing to FSDP2."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match="NO_SHARD"):
            wrapped = FullyShardedDataParallel(SmallMLP(hidden=False), device_id=torch.device("cpu"))
        assert [name for name, _ in wrapped.named_parameters()] == ["_fsdp_wrapped_module._flat_param"]
        policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
        with pytest.raises(GuardStateError) as info:
            GradGuard(wrapped, policy, logger=None)
    finally:
        if created:
            dist.destroy_process_group()
    message = str(info.value)
    assert "FullyShardedDataParallel" in message
    assert "fully_shard" in message


def test_a_deepspeed_engine_is_refused_with_a_clear_error() -> None:
    """A DeepSpeed engine (recognised by its class name; DeepSpeed itself is not installed) is refused."""

    class DeepSpeedEngine(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    with pytest.raises(GuardStateError, match="DeepSpeedEngine"):
        GradGuard(DeepSpeedEngine(SmallMLP(hidden=False)), policy, logger=None)


def _with_process_group(tmp_path: Path) -> bool:
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    return True


def test_fsdp1_is_refused_even_when_the_policy_names_the_models_parameters(tmp_path: Path) -> None:
    """A policy naming 'inp.*' gets the FSDP1 refusal, not a 'matches no parameter ... _flat_param' error."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    created = _with_process_group(tmp_path)
    try:
        with pytest.warns(UserWarning, match="NO_SHARD"):
            wrapped = FullyShardedDataParallel(SmallMLP(hidden=False), device_id=torch.device("cpu"))
        policy = make_policy({"match": "inp.*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]})
        with pytest.raises(GuardStateError, match="FullyShardedDataParallel"):
            GradGuard(wrapped, policy, logger=None)
    finally:
        if created:
            dist.destroy_process_group()


def test_fsdp1_wrapping_after_attach_is_refused_at_the_step_not_silently_rebound(tmp_path: Path) -> None:
    """Attach, then wrap in FSDP1: the next step raises the FSDP1 refusal instead of re-binding the policy to
    the flat parameter (which would turn a per-tensor clip into a clip of the whole model)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    created = _with_process_group(tmp_path)
    model = SmallMLP(hidden=False)
    guard = GradGuard(model, make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]}))
    try:
        with pytest.warns(UserWarning, match="NO_SHARD"):
            wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        wrapped(torch.randn(3, 8)).sum().backward()
        with pytest.raises(GuardStateError, match="FullyShardedDataParallel"):
            opt.step()
    finally:
        guard.remove()
        if created:
            dist.destroy_process_group()
