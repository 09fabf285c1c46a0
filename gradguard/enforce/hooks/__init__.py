"""The hooks into torch: where a step's boundary is found in the user's loop.

Owns ``torch_hooks`` (the global optimizer hooks and the interception of torch's clip utilities and GradScaler),
``guard_hooks`` (what those hooks ask of a guard, and which clip functions they wrap),
``bound_names`` (torch's clips a loaded module bound by name, swapped with the module attributes), ``clip_norms`` (a
clip bound by name elsewhere: its norm after the guard's step), ``scaler_view`` (what the
GradScalers say about some gradients), ``clips`` (the loop's own clip as a boundary),
``closures`` (``optimizer.step(closure)``), ``boundaries`` (a boundary's ``StepContext``), ``scaler`` (GradScaler's
flags and skips; the GradScaler watch's participant), ``micro_batch`` (the opt-in per-micro-batch hooks, a
participant) and ``pipeline_weights`` (pipelining's zero-bubble weight pass, which those hooks act in). They find
boundaries and hand them to the step; they do not run it.

May import: plans, triggers, actions, work, distributed.
"""
