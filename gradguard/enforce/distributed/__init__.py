"""The ranks: what every process of a job must agree on, and the one collective a step may take.

Owns the process group the guard agrees over (``collective``: ``Collective``, FSDP2's local shards and their combined
norms) and the agreement at attach and reload (``agreement``: every rank bound the same policy to the same
parameters). The bottom room: it knows no other room of ``enforce``.

May import: nothing of enforce.
"""
