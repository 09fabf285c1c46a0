"""What the guard records: the JSON-lines event log and the thread-safe counters."""
