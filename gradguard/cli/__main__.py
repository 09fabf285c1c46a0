"""``python -m gradguard.cli``: the same as the ``gradguard`` command."""

from gradguard.cli.main import run

run()
