"""What a policy says and which parameters it covers: the schema, loading files, matching names.

Nothing here but ``matching`` imports torch."""
