"""Development servers and the demo (not used by the runtime layers)."""
