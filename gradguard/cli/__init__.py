"""The ``gradguard`` command: ``demo``, ``validate``, ``explain``, ``audit`` and ``schema``."""

from gradguard.cli.main import main, run

__all__ = ["main", "run"]
