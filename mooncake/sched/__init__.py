"""Decisions, no I/O: the KV index, cost models, admission, predictions, the scheduler and its
booking, pipeline groups, and placement (plan, admit, book: the one call the conductor and the
simulator share)."""
