"""Coordination through Redis and among a worker's ranks: keys, signed records, registry, election, handshake, consensus."""
