"""Adapters that plug nccl_back into inference engines: :mod:`nccl_back.engines.common`
holds what every engine needs and the ``EngineAdapter`` protocol; each engine has one
module here, the only one importing that engine."""
