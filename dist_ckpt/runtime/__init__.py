"""Process-level machinery every layer may use; nothing here knows what a checkpoint is.

``durable`` (fsync and atomic replace: the only durability code), ``collectives``
(``DistWrapper``: steps whose failure on one rank is raised on every rank, with deadlines),
``interrupts`` (Ctrl-C deferred during commits, ignored by helper processes), ``launch`` (the
gloo process launcher of the demo and the tests), ``timing`` (phases for ``-v`` and progress
bars), ``shared_arena`` (shared memory that a background writer process maps once).
"""
