"""The steps of a save and of a load, each step's inputs and outputs explicit.

``serialization`` (Megatron-Core's public module) resolves the caller's arguments into a
``SaveRequest`` / ``LoadRequest`` and runs ``save.run_save`` / ``load.run_load``.
"""
