"""python3 -m oscar_cli demo | eval | plot | study: the same command line as oscar-jax."""

import sys

from oscar_cli.cli import main

sys.exit(main())
