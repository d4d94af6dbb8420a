"""``python3 -m models demo | eval | study``: the same command line as ``oscar-jax``."""

import sys

from models.cli import main

sys.exit(main())
