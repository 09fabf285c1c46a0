"""What the guard records: ``log`` (the JSON-lines event log, written by a background thread) and
``counters`` (thread-safe intervention counts)."""
