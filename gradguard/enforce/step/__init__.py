"""The step itself: one pipeline of stages, run at every boundary, and the participants that take part in it.

Owns ``pipeline`` (the stages in order: gather, open, device work, the one read, verdicts, report), ``participants``
(the protocol every participant implements, and their registration at attach), ``gather`` (where gradients live),
``device_work`` (the actions in policy order), ``verdicts`` (halts, skips, rewinds and their events), ``engine``
(``Enforcer``: what lasts across steps), ``fused_update`` (the read after a fused optimizer's update),
``known_norms`` (the loop's clip reusing the step's norms) and ``reload`` (a policy file changed while training). The
top room: everything else of ``enforce`` lies beneath it.

May import: hooks, provenance, recovery, triggers, plans, actions, work, distributed.
"""
