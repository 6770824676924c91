"""Compile caches and other artifact sets a worker fetches from peers: clients of the load, not part of it."""
