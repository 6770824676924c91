"""The sidecar: HTTP server, health, and the same-node hand-off."""
