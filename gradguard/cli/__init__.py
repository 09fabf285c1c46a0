"""The ``gradguard`` command: ``validate``, ``explain``, ``audit``, ``suggest``, ``replay``, ``schema``,
``policies`` and ``demo``. ``main`` is the command group; ``run`` is the console script (``main`` as the
process's own command)."""

from gradguard.cli.main import main, run

__all__ = ["main", "run"]
