"""The audit store: an insert-only, hash-chained log of every policy decision (DESIGN §4)."""
