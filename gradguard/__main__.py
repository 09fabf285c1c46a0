"""``python -m gradguard``: the same as the ``gradguard`` command (and ``python -m gradguard.cli``)."""

from gradguard.cli.main import run

if __name__ == "__main__":
    run()
