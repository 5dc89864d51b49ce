"""The PyTorch DCP format behind the 'torch_dist' strategy (``strategies.torch_dist``; Megatron-Core's
names for it are in ``strategies.torch``).

``plan`` (pure: who writes which item, which byte ranges a load reads), ``record`` (torch.save
records written and located without pickling tensors), ``files`` (``.distcp`` data files and the
``.metadata`` index, with checksums), ``read`` (the direct parallel reader into destination
tensors), ``staging`` (reused staging copies of an asynchronous save), ``metadata``
(Megatron-Core's DCP metadata classes).
"""
