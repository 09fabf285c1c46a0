"""``gradguard audit``: reads event logs back and turns them into an account of the run.

Never imports torch. The modules, in the order the data flows:

- ``gradguard.audit.command``: running the command: read (once, or following), summarize, render, plot.
- ``gradguard.audit.reader``: reading JSON-lines logs in chunks, merging files in step order, following
  growing ones; ``ReadStats`` counts lines and keeps the unreadable ones.
- ``gradguard.audit.filters``: ``--since/--until/--rule/--param`` (``Filters``) and their test on
  one event (``EventFilter``).
- ``gradguard.audit.summarizer``: ``Summarizer``, which hands each event to its run and to the
  collector of its kind, and assembles the ``AuditSummary``; events of other names are counted there.
- ``gradguard.audit.fields``: ``Malformed`` (an event
  that fits its definition, ``gradguard.events.definitions``, but not the audit's use).
- ``gradguard.audit.run_state``: ``RunState``, the whole-log bookkeeping of one run id.
- ``gradguard.audit.runs``: the run table: attach and detach, steps, times, how each run ended.
- ``gradguard.audit.counters``: the reproduced ``guard.counters.snapshot()`` of each run, and every
  counters snapshot cross-checked against the events (mismatches).
- ``gradguard.audit.interventions``: clips by (rule, action) and by parameter, group clips attributed.
- ``gradguard.audit.nonfinite``: non-finite gradients, steps that applied them, group norms left undone.
- ``gradguard.audit.halts_and_skips``: halts, rewinds (recovery), steps the guard skipped, steps GradScaler
  skipped.
- ``gradguard.audit.summary``: the data model: ``AuditSummary`` and its rows, and its findings.
- ``gradguard.audit.render``: reports as text, Markdown or JSON (sections and tables, which
  ``gradguard explain`` uses too), and the sections of the audit report;
  ``gradguard.audit.stops_report`` its halts, rewinds and skipped steps, and
  ``gradguard.audit.layout`` the pieces they are laid out with.
- ``gradguard.audit.plot``: ``--plot``: the most-affected series over the steps (matplotlib, optional).
"""
