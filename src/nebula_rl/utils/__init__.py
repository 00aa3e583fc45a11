"""Helpers with no place of their own: sockets, the HTTP server thread, metric sinks, profiling,
a replica's ranks, exit signals, visible GPUs, Hub names and sequence splitting for context
parallelism."""
