"""The ``oscar-jax`` command line (``oscar_cli.cli.main``) and its demo."""
