"""``gradguard audit``: reads event logs back and turns them into an account of the run.

Never imports torch."""
