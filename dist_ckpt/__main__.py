"""``python -m dist_ckpt ...`` is the ``dist-ckpt`` command."""

import sys

from .tools.cli import main

sys.exit(main())
