"""What the guard records: ``log`` (the JSON-lines event log, written by a background thread),
``counters`` (thread-safe intervention counts) and ``prometheus`` (the counters served live to
Prometheus; ``prometheus_client`` is imported only when a server starts)."""
