"""``python -m tq_jax``: the ``tq-jax`` command."""

import sys

from tq_jax.cli import main

sys.exit(main())
