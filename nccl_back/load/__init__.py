"""The load: WeightService and the protocol's phases."""
