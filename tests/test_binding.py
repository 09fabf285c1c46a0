"""Binding a policy to a model: patterns, exclusions, rules that match nothing, tied weights, wrappers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from gradguard import GradGuard, Policy, PolicyError


def _guarded(model: nn.Module, *rules) -> dict[str, tuple[str, ...]]:
    policy = Policy.from_dict({"version": 1, "rules": [{"name": f"r{i}", **rule} for i, rule in enumerate(rules)]})
    with GradGuard(model, policy, logger=None) as guard:
        return guard.guarded


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


ZERO = [{"action": "zero"}]


def test_glob_star_crosses_dots_and_must_match_the_whole_name(make_workload):
    """A glob matches the whole dotted name, and '*' also crosses dots."""
    model = make_workload("decoder").model
    covered = _guarded(model, {"match": "blocks.*.weight", "actions": ZERO})
    expected = [name for name in _names(model) if name.startswith("blocks.") and name.endswith(".weight")]
    assert list(covered) == expected
    assert "blocks.0.mlp.0.weight" in covered  # '*' stood for '0.mlp.0'
    with pytest.raises(PolicyError):
        _guarded(model, {"match": "attn", "actions": ZERO})  # a substring is not a match
    assert list(_guarded(model, {"match": "*attn*", "actions": ZERO})) == [n for n in _names(model) if "attn" in n]


def test_regex_patterns_must_match_the_whole_name(make_workload):
    """'re:' patterns are Python regexes that must match the full dotted name, not a part of it."""
    model = make_workload("decoder").model
    covered = _guarded(model, {"match": r"re:blocks\.\d+\.attn\.(in|out)_proj.*", "actions": ZERO})
    assert list(covered) == [n for n in _names(model) if n.startswith("blocks.") and ".attn." in n]
    with pytest.raises(PolicyError, match="matches no parameter"):
        _guarded(model, {"match": r"re:attn", "actions": ZERO})
    with pytest.raises(PolicyError, match="matches no parameter"):
        _guarded(model, {"match": r"re:blocks\.0", "actions": ZERO})


def test_exclude_removes_parameters_from_a_rule(make_workload):
    """exclude patterns (globs or regexes) take parameters out of the rule's match."""
    model = make_workload("decoder").model
    covered = _guarded(model, {"match": "blocks.*", "exclude": ["*.bias", r"re:.*norm\d\..*"], "actions": ZERO})
    expected = [n for n in _names(model) if n.startswith("blocks.") and not n.endswith(".bias") and ".norm" not in n]
    assert list(covered) == expected
    assert not any(name.endswith(".bias") for name in covered)


def test_rule_matching_nothing_names_the_rule_and_the_nearest_parameters(make_workload, tmp_path):
    """A rule that matches nothing is a PolicyError naming the rule, its file and line, and the nearest names."""
    model = make_workload("decoder").model
    path = tmp_path / "typo.yaml"
    path.write_text(
        "version: 1\n"
        "rules:\n"
        "  - name: ok\n"
        "    match: '*'\n"
        "    actions: [{action: halt_on_nonfinite}]\n"
        "  - name: attention\n"
        "    match: ['blocks.*.atn.*']\n"
        "    actions: [{action: clip_norm, max_norm: 1.0}]\n"
    )
    with pytest.raises(PolicyError) as info:
        GradGuard(model, path, logger=None)
    exc = info.value
    assert type(exc) is PolicyError
    (issue,) = exc.issues
    assert issue.source == str(path)
    assert issue.line == 6
    assert issue.path == "rules[1].match"
    assert "'attention' matches no parameter" in issue.message
    assert "blocks.0.attn." in issue.message  # the nearest real names are suggested
    assert "allow_no_match" in issue.message


def test_all_rules_matching_nothing_are_reported_together(make_workload, make_policy):
    """Every empty rule is listed in one PolicyError."""
    model = make_workload("mlp").model
    with pytest.raises(PolicyError) as info:
        GradGuard(model, make_policy({"match": "encoder.*", "actions": ZERO}, {"match": "decoder.*", "actions": ZERO}))
    assert [issue.path for issue in info.value.issues] == ["rules[0].match", "rules[1].match"]
    assert "hidden" in str(info.value) or "inp" in str(info.value) or "out" in str(info.value)


def test_allow_no_match_lets_a_rule_match_nothing(make_workload, make_policy):
    """allow_no_match: true accepts a rule that matches no parameter (e.g. a router on a dense model)."""
    model = make_workload("mlp").model
    policy = make_policy(
        {"name": "router", "match": "*router*", "allow_no_match": True, "actions": ZERO},
        {"name": "all", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        assert all(rules == ("all",) for rules in guard.guarded.values())


def test_tied_parameter_matches_under_every_name_and_is_acted_on_once(make_workload, make_optimizer, make_policy, same):
    """A head tied to the embedding is matched as head.weight too, and a 0.5 scale on both names scales by 0.5 once."""
    guarded = make_workload("decoder")
    assert guarded.model.head.weight is guarded.model.embed.weight

    only_head = make_policy({"name": "head", "match": "head.weight", "actions": [{"action": "scale", "factor": 0.5}]})
    with GradGuard(guarded.model, only_head, logger=None) as guard:
        assert guard.guarded == {"embed.weight": ("head",)}  # one tensor, reported under its first name

    both = make_policy(
        {"name": "tied", "match": ["embed.weight", "head.weight"], "actions": [{"action": "scale", "factor": 0.5}]}
    )
    reference = guarded.clone()
    opt_g = make_optimizer("adamw", guarded.model.parameters())
    opt_r = make_optimizer("adamw", reference.model.parameters())
    with GradGuard(guarded.model, both, logger=None) as guard:
        for step in range(2):
            for side, opt in ((guarded, opt_g), (reference, opt_r)):
                opt.zero_grad()
                side.backward(step)
            raw = reference.model.embed.weight.grad.clone()
            reference.model.embed.weight.grad.mul_(0.5)
            opt_g.step()
            opt_r.step()
            assert torch.equal(guarded.model.embed.weight.grad, reference.model.embed.weight.grad)
            assert not torch.equal(guarded.model.embed.weight.grad, raw * 0.25)
            same(dict(guarded.model.named_parameters()), dict(reference.model.named_parameters()))
        assert guard.counters.snapshot() == {"tied": {"scale": 2}}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports warn
def test_torch_compile_wrapper_matches_the_same_names_as_the_bare_model(make_workload, make_policy, same):
    """A model wrapped by torch.compile (names under _orig_mod.) binds exactly like the bare model, and is guarded."""
    workload = make_workload("decoder")
    rules = (
        {"name": "attn", "match": r"re:blocks\.\d+\.attn\..*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
        {"name": "embed", "match": ["embed.*", "head.*", "pos_embed"], "actions": [{"action": "scale", "factor": 0.5}]},
    )
    bare = _guarded(workload.model, *rules)
    compiled = torch.compile(workload.model)
    assert all(name.startswith("_orig_mod.") for name, _ in compiled.named_parameters())
    reference = workload.clone()
    with GradGuard(compiled, make_policy(*rules), logger=None) as guard:
        assert guard.guarded == bare
        # The compiled wrapper shares the parameters: a step through the bare module is the guarded step.
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
        workload.backward(0)
        reference.backward(0)
        opt.step()
        assert guard.counters.snapshot()["embed"] == {"scale": 2}
        assert guard.counters.snapshot()["attn"]["clip_norm"] > 0
    assert torch.equal(workload.model.embed.weight.grad, reference.model.embed.weight.grad * 0.5)


def test_checkpoint_wrapper_matches_the_same_names_as_the_bare_model(make_workload, make_optimizer, make_policy, same):
    """Blocks wrapped by checkpoint_wrapper (names under _checkpoint_wrapped_module.) bind and train like bare ones."""
    rules = (
        {"name": "attn", "match": r"re:blocks\.\d+\.attn\..*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
        {"name": "mlp", "match": "blocks.1.mlp.*", "actions": [{"action": "scale", "factor": 0.5}]},
    )
    bare = make_workload("decoder")
    wrapped = bare.clone()
    for index, block in enumerate(wrapped.model.blocks):
        wrapped.model.blocks[index] = checkpoint_wrapper(block)
    assert any("._checkpoint_wrapped_module." in name for name, _ in wrapped.model.named_parameters())

    opts = [make_optimizer("adamw", side.model.parameters()) for side in (bare, wrapped)]
    guards = [GradGuard(side.model, make_policy(*rules), logger=None) for side in (bare, wrapped)]
    try:
        assert guards[0].guarded == guards[1].guarded
        assert list(guards[0].guarded)
        assert all(guards[0].guarded.values())
        for step in range(2):
            for side, opt in zip((bare, wrapped), opts, strict=True):
                opt.zero_grad()
                side.backward(step)
                opt.step()
        assert guards[0].counters.snapshot() == guards[1].counters.snapshot()
        same(list(bare.model.parameters()), list(wrapped.model.parameters()))
    finally:
        for guard in guards:
            guard.remove()


def test_guarded_lists_every_covered_parameter_with_its_rules_in_order(make_workload, make_policy):
    """guard.guarded maps each covered parameter (model order) to the names of its rules (policy order)."""
    model = make_workload("mlp").model
    policy = make_policy(
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "weights", "match": "*.weight", "exclude": "out.*", "actions": [{"action": "clip_value", "limit": 1}]},
        {"name": "out", "match": "out.*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        assert guard.guarded == {
            "inp.weight": ("halt", "weights"),
            "inp.bias": ("halt",),
            "hidden.weight": ("halt", "weights"),
            "hidden.bias": ("halt",),
            "out.weight": ("halt", "out"),
            "out.bias": ("halt", "out"),
        }
        assert list(guard.guarded) == _names(model)


def test_parameters_no_rule_matches_are_not_guarded(make_workload, make_policy):
    """Parameters outside every rule are absent from guard.guarded and their gradients are untouched."""
    workload = make_workload("mlp")
    policy = make_policy({"match": "out.*", "actions": ZERO})
    with GradGuard(workload.model, policy, logger=None) as guard:
        assert list(guard.guarded) == ["out.weight", "out.bias"]
        workload.backward(0)
        raw = workload.model.inp.weight.grad.clone()
        torch.optim.SGD(workload.model.parameters(), lr=0.1).step()
        assert torch.equal(workload.model.inp.weight.grad, raw)
        assert not bool(workload.model.out.weight.grad.any())
