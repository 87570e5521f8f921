"""``python -m examples.smollm2 {quality,passkey,speed} ...`` (see :mod:`.cli`)."""

from .cli import main

raise SystemExit(main())
