"""The hooks into torch: where a step's boundary is found in the user's loop.

Owns ``torch_hooks`` (the global optimizer hooks and the interception of torch's clip utilities), ``clips`` (the
loop's own clip as a boundary), ``closures`` (``optimizer.step(closure)``), ``scaler`` (GradScaler's flags and skips)
and ``micro_batch`` (the opt-in per-micro-batch hooks). They find boundaries and hand them to the step; they do not
run it.

May import: plans, triggers, actions, work, distributed.
"""
