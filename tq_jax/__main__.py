"""``python -m tq_jax``: the ``tq-jax`` command."""

import sys

from tq_jax._src.cli import main

sys.exit(main())
