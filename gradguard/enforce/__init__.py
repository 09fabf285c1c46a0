"""The step engine: applies a bound policy to the gradients at the step boundary, in rooms.

Each room is a subpackage whose docstring says what it owns and which rooms it may import (its ``May import:``
line, which ``tests/test_package_layout.py`` checks); from the bottom up:

- ``distributed``: the ranks (the collective, FSDP2's shards, agreement);
- ``work``: what one step works with (its context, the one read, its outcome, the tensor maths);
- ``actions``: the action families behind one interface (``ActionKernel``);
- ``plans``: which action acts on which tensor, and the plan of each optimizer;
- ``triggers``, ``recovery``, ``provenance``: the participants' rooms (the loss, the re-run, the monitors; snapshots
  and rewinds; where a NaN started);
- ``hooks``: where the boundary is found in the user's loop (optimizer hooks, the loop's clip, closures, GradScaler);
- ``step``: the step as one pipeline of stages, its participants' protocol, and what lasts across steps.

docs/development.md, "How a step runs", follows one step through them.
"""
