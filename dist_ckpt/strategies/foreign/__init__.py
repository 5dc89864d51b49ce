"""Readers of checkpoints other tools wrote, registered like any backend (``storage.formats``
recognises them): ``dcp_native`` (plain ``torch.distributed.checkpoint.save``) and
``hf_safetensors`` (Hugging Face ``*.safetensors`` directories)."""
