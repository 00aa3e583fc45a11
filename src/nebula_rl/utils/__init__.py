"""Helpers with no place of their own: run folders, object storage, validation's schedule,
sockets, the HTTP server thread, metric sinks, profiling, a replica's ranks, exit signals, visible
GPUs, Hub names, sequence splitting for context parallelism, and the multi-turn tools' sandbox."""
