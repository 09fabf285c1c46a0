"""Every policy in policies/ loads, binds to a real model of the kind it is written for, and trains."""

from __future__ import annotations

import math
import re
import sys
import urllib.parse
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gradguard import GradGuard, Policy, PolicyError
from gradguard.cli import main
from gradguard.policy.matching import bind
from gradguard.policy.shipped import SHIPPED_PURPOSES

POLICIES = Path(__file__).resolve().parent.parent / "policies"

# Which small model each shipped policy is meant for (see conftest: names follow the real architectures).
TARGETS = {
    "default.yaml": ("mlp", "decoder", "resnet"),
    "per-tensor-clip.yaml": ("mlp", "decoder"),
    "llm-pretraining.yaml": ("moe", "decoder"),
    "llm-adaptive.yaml": ("moe", "decoder"),
    "finetune-frozen-backbone.toml": ("finetune",),
    "vision.json": ("resnet",),
}
CASES = [(name, workload) for name, workloads in TARGETS.items() for workload in workloads]


def test_every_shipped_policy_has_a_target_model():
    """No policy file ships untested: the files in policies/ are exactly those listed here (and the JSON Schema)."""
    files = sorted(path.name for path in POLICIES.iterdir() if path.is_file())
    assert files == sorted([*TARGETS, "gradguard-policy.schema.json"])


def _train(workload, policy_path: Path, log: Path, steps: int = 5, opt_name: str = "adamw"):
    opt = (
        torch.optim.SGD(workload.model.parameters(), lr=0.05)
        if opt_name == "sgd"
        else torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    )
    start = {name: p.detach().clone() for name, p in workload.model.named_parameters()}
    losses = []
    with GradGuard(workload.model, policy_path, audit_log=log, logger=None) as guard:
        for step in range(steps):
            opt.zero_grad()
            losses.append(float(workload.backward(step)))
            opt.step()
        guarded = guard.guarded
        counters = guard.counters.snapshot()
        assert guard.step_count == steps
    moved = {name for name, p in workload.model.named_parameters() if not torch.equal(p, start[name])}
    return guarded, counters, losses, moved


@pytest.mark.parametrize(("policy_name", "workload_name"), CASES)
def test_shipped_policy_loads_binds_and_trains(make_workload, read_audit, tmp_path, policy_name, workload_name):
    """The policy loads, every rule binds (or may match nothing), every parameter is halt-covered, steps run."""
    path = POLICIES / policy_name
    policy = Policy.from_file(path)
    workload = make_workload(workload_name)
    names = [name for name, _ in workload.model.named_parameters()]
    guarded, counters, losses, moved = _train(workload, path, tmp_path / "audit.jsonl")

    assert list(guarded) == names  # every parameter is covered (by the halt rule at least)
    assert all(rules[0] == "nonfinite" for rules in guarded.values())  # a halt or skip rule covers everything
    for rule in policy.rules:
        covering = [name for name, rules in guarded.items() if rule.name in rules]
        assert covering or rule.allow_no_match, f"rule {rule.name!r} covers nothing on {workload_name}"
    assert all(math.isfinite(loss) for loss in losses)
    assert moved  # training happened
    if policy_name == "default.yaml":
        assert counters == {}  # transparent on a healthy run: nothing clipped, nothing counted
    else:
        assert counters  # the policy did something
    assert "nonfinite" not in counters
    events = read_audit(tmp_path / "audit.jsonl")
    assert events[0]["policy"] == str(path)
    assert events[0]["rules"] == {
        rule.name: sum(rule.name in rules for rules in guarded.values()) for rule in policy.rules
    }


def test_llm_policy_covers_embeddings_attention_router_and_everything_on_a_moe_decoder(make_workload, tmp_path):
    """On a MoE decoder, llm-pretraining.yaml clips the tied embedding, attention weights (not biases) and routers."""
    workload = make_workload("moe")
    guarded, counters, _, _ = _train(workload, POLICIES / "llm-pretraining.yaml", tmp_path / "a.jsonl")
    assert guarded["embed.weight"] == ("nonfinite", "embeddings", "warmup-global", "health")  # also head.weight, tied
    assert "head.weight" not in guarded
    for block in (0, 1):
        assert guarded[f"blocks.{block}.attn.in_proj_weight"] == ("nonfinite", "attention", "warmup-global", "health")
        assert guarded[f"blocks.{block}.attn.out_proj.bias"] == (
            "nonfinite",
            "warmup-global",
            "health",
        )  # the attention rule matches weights only
        assert guarded[f"blocks.{block}.router.weight"] == ("nonfinite", "router", "warmup-global", "health")
        assert guarded[f"blocks.{block}.mlp.0.up.weight"] == ("nonfinite", "warmup-global", "health")
    assert counters["router"]["scale"] == 4 * 5  # two blocks x (weight, bias) x five steps


def test_llm_policy_attaches_to_a_bias_less_nanogpt_without_a_warning_and_clips_its_attention_weights() -> None:
    """nanoGPT with ``bias=False`` (as Llama): no GuardWarning at attach (pytest turns one into an error), and the
    attention rule takes ``c_attn`` and ``c_proj``'s weights of every block."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import host_time
    finally:
        sys.path.pop(0)
    model = host_time.GPT(vocab=65, context=16, layers=2, heads=2, width=32)
    for module in model.modules():  # nanoGPT's bias=False: no bias anywhere
        if isinstance(module, torch.nn.Linear | torch.nn.LayerNorm) and module.bias is not None:
            module.bias = None
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    policy = Policy.shipped("llm-pretraining")
    GradGuard(model, policy, logger=None).remove()
    rule = next(index for index, each in enumerate(policy.rules) if each.name == "attention")
    attention = {param.name for param in bind(policy, model).params if rule in param.rules}
    assert attention == {f"transformer.h.{i}.attn.{part}.weight" for i in (0, 1) for part in ("c_attn", "c_proj")}


def test_finetune_policy_holds_early_layers_still_and_slows_the_backbone(make_workload, tmp_path):
    """finetune-frozen-backbone.toml: with plain SGD, embed and layers 0-1 do not move; layers 2-3 and head do."""
    workload = make_workload("finetune")
    path = POLICIES / "finetune-frozen-backbone.toml"
    guarded, counters, _, moved = _train(workload, path, tmp_path / "f.jsonl", opt_name="sgd")
    frozen = {name for name, rules in guarded.items() if "frozen-early-layers" in rules}
    assert frozen == {"embed.weight", *(f"layers.{i}.0.{kind}" for i in (0, 1) for kind in ("weight", "bias"))}
    assert not frozen & moved
    assert moved == set(guarded) - frozen
    assert all(guarded[f"layers.{i}.0.weight"] == ("nonfinite", "backbone-slow", "health") for i in (2, 3))
    assert guarded["head.weight"] == ("nonfinite", "head", "health")
    assert counters["frozen-early-layers"] == {"zero": len(frozen) * 5}
    assert counters["backbone-slow"]["scale"] == 4 * 5


def test_vision_policy_covers_convolutions_norms_and_classifier_of_a_resnet(make_workload, tmp_path):
    """vision.json on a ResNet-like net: conv weights and downsample clipped by value, BN by norm, fc by norm."""
    workload = make_workload("resnet")
    guarded, counters, _, _ = _train(workload, POLICIES / "vision.json", tmp_path / "v.jsonl")
    assert guarded["conv1.weight"] == ("nonfinite", "conv", "health")
    assert guarded["layer2.0.conv2.weight"] == ("nonfinite", "conv", "health")
    assert guarded["layer2.0.downsample.0.weight"] == ("nonfinite", "conv", "health")
    assert guarded["layer2.0.downsample.1.weight"] == ("nonfinite", "conv", "health")
    assert guarded["bn1.weight"] == ("nonfinite", "norm-layers", "health")
    assert guarded["layer1.0.bn2.bias"] == ("nonfinite", "norm-layers", "health")
    assert guarded["fc.weight"] == ("nonfinite", "classifier", "health")
    assert counters["conv"]["clip_value"] > 0


def test_adaptive_llm_policy_skips_an_injected_spike_and_keeps_its_statistics(make_workload, read_audit, tmp_path):
    """llm-adaptive.yaml on a decoder: after its 64-step warm-up the spike watch skips a 1000x gradient."""
    workload = make_workload("decoder")
    opt = torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    log = tmp_path / "audit.jsonl"
    skipped = []
    with GradGuard(workload.model, POLICIES / "llm-adaptive.yaml", audit_log=log, logger=None) as guard:
        for step in range(80):
            opt.zero_grad()
            workload.backward(step)
            if step == 75:
                for param in workload.model.parameters():
                    param.grad.mul_(1000.0)
            opt.step()
            if guard.last_step_skipped:
                skipped.append(step)
        statistics = guard.state_dict()["statistics"]
        counters = guard.counters.snapshot()
    assert skipped == [75]
    assert counters["spikes"] == {"skip_step_on_spike": 1}
    assert counters["embeddings"]["autoclip"] > 0
    assert set(statistics) == {"spikes", "embeddings", "blocks"}
    spike = next(e for e in read_audit(log) if e["event"] == "spike_skip")
    assert spike["step"] == 75
    assert spike["z"] > 6.0


# --- by name: Policy.shipped and `gradguard policies` ----------------------------------------------


def test_every_shipped_policy_loads_by_name_as_from_its_file():
    """Policy.shipped(stem) and Policy.shipped(file name) equal Policy.from_file of the file in policies/."""
    for name in TARGETS:
        assert Policy.shipped(Path(name).stem) == Policy.from_file(POLICIES / name)
        assert Policy.shipped(name) == Policy.from_file(POLICIES / name)


def test_every_shipped_policy_says_what_it_is_for():
    """Each shipped file has a one-line purpose, and no purpose names a file that is not shipped."""
    assert sorted(SHIPPED_PURPOSES) == sorted(Path(name).stem for name in TARGETS)
    assert all(purpose and "\n" not in purpose for purpose in SHIPPED_PURPOSES.values())


def test_an_unknown_shipped_name_is_a_policy_error_listing_the_names():
    """The message repeats the name, suggests the closest one and lists every shipped policy."""
    with pytest.raises(PolicyError) as caught:
        Policy.shipped("defualt")
    message = str(caught.value)
    assert "no shipped policy is called 'defualt' (did you mean 'default'?)" in message
    for name in TARGETS:
        assert Path(name).stem in message


def test_gradguard_policies_lists_each_policy_with_its_file_and_purpose():
    """One line per shipped policy: name, file name, purpose; then how to print or load one."""
    result = CliRunner().invoke(main, ["policies"])
    assert result.exit_code == 0, result.output
    for name in TARGETS:
        stem = Path(name).stem
        line = rf"^{re.escape(stem)} +{re.escape(name)} +{re.escape(SHIPPED_PURPOSES[stem])}$"
        assert re.search(line, result.output, re.M), result.output
    assert "gradguard policies NAME > my-policy.yaml" in result.output


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_printed_policy_validates_where_it_is_saved_and_its_schema_resolves(name, tmp_path):
    """`gradguard policies NAME > copy` validates elsewhere; its $schema is the installed schema's file URI."""
    result = CliRunner().invoke(main, ["policies", Path(name).stem])
    assert result.exit_code == 0, result.output
    copy = tmp_path / f"my-policy{Path(name).suffix}"
    copy.write_text(result.output, encoding="utf-8")
    assert Policy.from_file(copy) == Policy.from_file(POLICIES / name)
    assert "./gradguard-policy.schema.json" not in result.output
    (uri,) = re.findall(r"file://\S+?\.schema\.json", result.output)
    assert Path(urllib.parse.urlparse(uri).path).read_text(encoding="utf-8").startswith("{")
    assert CliRunner().invoke(main, ["validate", str(copy)]).exit_code == 0


def test_gradguard_policies_with_an_unknown_name_exits_2_and_lists_the_names():
    """A typo is an input error (exit 2) that names the closest policy and all of them."""
    result = CliRunner().invoke(main, ["policies", "vison"])
    assert result.exit_code == 2
    assert "no shipped policy is called 'vison' (did you mean 'vision'?)" in result.output
    assert "default, finetune-frozen-backbone, llm-adaptive, llm-pretraining, per-tensor-clip, vision" in result.output
