"""Policies from recorded runs: ``gradguard suggest`` learns thresholds, ``gradguard replay`` tries a policy.

Both read what a ``monitor`` recorded (each tensor's gradient norm as it arrived, before any action).
The modules, in the order the data flows:

- ``gradguard.tuning.records``: the recorded norms, streamed out of audit logs one step at a time.
- ``gradguard.tuning.histogram``: ``LogHistogram``, a bounded summary of ``ln(norm)`` (bins 1% wide).
- ``gradguard.tuning.families``: parameter families by name (layer index folded), merged by norm.
- ``gradguard.tuning.suggest``: per-family thresholds from robust statistics, rendered as commented YAML.
- ``gradguard.tuning.replay``: a policy run over recorded norms as the guard's step engine would run it.
- ``gradguard.tuning.report``: ``replay``'s text and JSON reports.
"""

from __future__ import annotations

from gradguard.tuning.histogram import LogHistogram
from gradguard.tuning.records import MONITOR_HINT, RecordedStep, Recording, recorded_steps
from gradguard.tuning.replay import ActionSteps, Halt, Replayer, ReplayResult, Undecidable, replay_files
from gradguard.tuning.suggest import NoNorms, Suggestion, Threshold, suggest_files

__all__ = [
    "MONITOR_HINT",
    "ActionSteps",
    "Halt",
    "LogHistogram",
    "NoNorms",
    "RecordedStep",
    "Recording",
    "ReplayResult",
    "Replayer",
    "Suggestion",
    "Threshold",
    "Undecidable",
    "recorded_steps",
    "replay_files",
    "suggest_files",
]
