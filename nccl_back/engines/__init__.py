"""Adapters that plug nccl_back into inference engines.

:mod:`nccl_back.engines.common` holds what every engine needs and the
:class:`~nccl_back.engines.common.EngineAdapter` protocol an adapter implements. Each
engine has one module here and only that module imports the engine, so the library
itself never depends on one: :mod:`nccl_back.engines.vllm` registers the ``nccl_back``
load format with vLLM (``--load-format nccl_back``) through vLLM's
``vllm.general_plugins`` entry point.
"""
