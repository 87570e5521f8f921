"""`import tq_jax` stays pure JAX + numpy: torch and lmcache load only with the bridge."""

import subprocess
import sys


def test_import_tq_jax_does_not_import_torch_or_lmcache():
    code = (
        "import sys, tq_jax; "
        "bad = sorted(m for m in ('torch', 'lmcache') if m in sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
