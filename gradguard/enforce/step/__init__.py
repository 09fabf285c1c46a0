"""The step itself: one pipeline of stages, run at every boundary, and the participants that take part in it.

Owns ``pipeline`` (the stages in order: gather, open, device work, the one read, verdict, report), ``participants``
(the registry of participants, built at attach from the guard's parts and policy), ``gather`` (where gradients
live), ``book`` (the step count, and which gradients were treated), ``device_work`` (the actions in policy order),
``verdicts`` (halts, skips, rewinds and their events), ``engine`` (``Enforcer``: what lasts across steps, and the
guard's entry points), ``fused_update`` (the read after a fused optimizer's update), ``known_norms`` (the loop's
clip reusing the step's norms), ``summary`` (the counters' summary) and ``reload`` (a policy file changed while
training). The
top room: everything else of ``enforce`` lies beneath it.

May import: hooks, provenance, recovery, triggers, plans, actions, work, distributed.
"""
