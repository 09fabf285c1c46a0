"""The ``gradguard`` command: ``demo``, ``validate``, ``explain`` and ``audit``."""

from gradguard.cli.main import main

__all__ = ["main"]
