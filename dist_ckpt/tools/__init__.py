"""What sits on top of the library: the ``dist-ckpt`` command (``cli``) and what it runs -
``convert`` (between backends), ``export`` (to Hugging Face safetensors), ``diff``, ``inspection``,
``check`` (``dist-ckpt validate``), ``demo`` - and ``streaming`` (one whole tensor at a time).
Nothing below imports from here."""
