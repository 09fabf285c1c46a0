"""The step engine: applies a bound policy to the gradients at the step boundary.

- ``engine``: ``Enforcer``, one pass per step: gather, run the actions, one host sync, report;
- ``actions/``: the action families behind one interface (clipping, shaping, the non-finite watch);
- ``plan`` / ``plans``: what a pass treats, and the plan of each optimizer (re-bound when the model changes);
- ``step``: a pass's context, its pending figures (the one sync) and its outcome;
- ``verdicts``: counters, events, halts and skips after the sync;
- ``closures``, ``scaler``: ``optimizer.step(closure)`` and GradScaler at the boundary;
- ``distributed``, ``micro_batch``: agreement across ranks, and the opt-in per-micro-batch hooks;
- ``tensors``: batched norms, clip coefficients and clamps, bitwise as torch's.
"""
