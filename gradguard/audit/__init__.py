"""``gradguard audit``: reads event logs back and turns them into an account of the run.

Never imports torch. The modules, in the order the data flows:

- ``gradguard.audit.command``: running the command: read (once, or following), summarize, render, plot.
- ``gradguard.audit.reader``: reading JSON-lines logs in chunks, merging files in step order (``merging``: a run of
  one file's records at a time), following growing ones; ``ReadStats`` counts lines and keeps the unreadable ones.
- ``gradguard.audit.filters``: ``--since/--until/--rule/--param`` (``Filters``) and their test on
  one event (``EventFilter``).
- ``gradguard.audit.summarizer``: ``Summarizer``: builds the registered collectors side by side and the one
  dispatcher, and gathers the ``AuditSummary`` from the collectors' parts, findings and sections.
- ``gradguard.audit.dispatch``: ``Dispatcher``, the one place every line goes through: its run (``run_book``), its
  replica mark (``jobs``), then each collector registered for its type; clips of one tensor in streaks.
- ``gradguard.audit.collector``: what a collector is (``Collector``: the events it reads, its part of the summary,
  its findings); ``gradguard.audit.collectors``: where they are registered, one line each.
- ``gradguard.audit.run_book``: ``RunBook``, the runs and jobs found; ``gradguard.audit.jobs``: ``Job``, the runs
  of one distributed job and its replicas; ``gradguard.audit.run_state``: ``RunState``, one run's bookkeeping.
- ``gradguard.audit.fields``: ``Malformed`` (an event
  that fits its definition, ``gradguard.events.definitions``, but not the audit's use).
- The collectors, one section each: ``runs`` (the run table: attach and detach, steps, times, how each run ended,
  the jobs and totals), ``counters`` (every counted event counted as the guard counted it, ``counting``, and every
  counters snapshot cross-checked: mismatches), ``interventions`` (clips by (rule, action) and by parameter),
  ``nonfinite`` (non-finite gradients, steps that applied them, group norms left undone), ``halts_and_skips``
  (halts, rewinds, skipped steps, GradScaler's), ``health``, ``loss_report``, ``rerun_report``, ``ranks_report``,
  ``other_events`` (events no collector reads).
- ``gradguard.audit.summary``: the data model: ``AuditSummary`` and its rows, and its findings.
- ``gradguard.audit.render``: reports as text, Markdown or JSON (sections and tables, which
  ``gradguard explain`` uses too), and the sections of the audit report;
  ``gradguard.audit.stops_report`` its halts, rewinds and skipped steps, and
  ``gradguard.audit.layout`` the pieces they are laid out with.
- ``gradguard.audit.plot``: ``--plot``: the most-affected series over the steps (matplotlib, optional).
"""
