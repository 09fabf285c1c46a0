"""``gradguard audit``: reads event logs back and turns them into an account of the run.

Never imports torch. The modules, in the order the data flows:

- :mod:`~gradguard.audit.command`: running the command: read (once, or following), summarize, render, plot.
- :mod:`~gradguard.audit.reader`: reading JSON-lines logs in chunks, merging files in step order, following
  growing ones; :class:`ReadStats` counts lines and keeps the unreadable ones.
- :mod:`~gradguard.audit.filters`: ``--since/--until/--rule/--param`` (:class:`Filters`) and their test on
  one event (:class:`EventFilter`).
- :mod:`~gradguard.audit.summarizer`: :class:`Summarizer`, which hands each event to its run and to the
  collector of its kind, and assembles the :class:`AuditSummary`; events of other names are counted there.
- :mod:`~gradguard.audit.fields`: reading an event's fields, or :class:`Malformed` (an unreadable line).
- :mod:`~gradguard.audit.run_state`: :class:`RunState`, the whole-log bookkeeping of one run id.
- :mod:`~gradguard.audit.runs`: the run table: attach and detach, steps, times, how each run ended.
- :mod:`~gradguard.audit.counters`: the reproduced ``guard.counters.snapshot()`` of each run, and every
  counters snapshot cross-checked against the events (mismatches).
- :mod:`~gradguard.audit.interventions`: clips by (rule, action) and by parameter, group clips attributed.
- :mod:`~gradguard.audit.nonfinite`: non-finite gradients, steps that applied them, group norms left undone.
- :mod:`~gradguard.audit.halts_and_skips`: halts, rewinds (recovery), steps the guard skipped, steps GradScaler
  skipped.
- :mod:`~gradguard.audit.summary`: the data model: :class:`AuditSummary` and its rows, and its findings.
- :mod:`~gradguard.audit.render`: reports as text, Markdown or JSON (sections and tables, which
  ``gradguard explain`` uses too), and the sections of the audit report;
  :mod:`~gradguard.audit.stops_report` its halts, rewinds and skipped steps, and
  :mod:`~gradguard.audit.layout` the pieces they are laid out with.
- :mod:`~gradguard.audit.plot`: ``--plot``: the most-affected series over the steps (matplotlib, optional).
"""
