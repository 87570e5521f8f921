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


def test_import_tq_jax_is_light_and_every_public_name_resolves():
    """`import tq_jax` loads neither numpy nor jax (the CLI installs its signal handlers
    first); each name in __all__ then loads its module on first use."""
    code = (
        "import sys, tq_jax; "
        "heavy = sorted(m for m in ('jax', 'numpy', 'jaxlib') if m in sys.modules); "
        "assert not heavy, heavy; "
        "import tq_jax.codec, tq_jax.blob, tq_jax.wire, tq_jax.options; "
        "mods = {'codec': tq_jax.codec, 'blob': tq_jax.blob, 'wire': tq_jax.wire, 'options': tq_jax.options}; "
        "assert all(getattr(tq_jax, n) is getattr(mods[tq_jax._EXPORTS[n].split('.')[1]], n) for n in tq_jax.__all__); "
        "ns = {}; exec('from tq_jax import *', ns); "
        "assert set(tq_jax.__all__) <= set(ns), set(tq_jax.__all__) - set(ns); "
        "assert set(tq_jax.__all__) <= set(dir(tq_jax)); "
        "import pytest; "
        "pytest.raises(AttributeError, getattr, tq_jax, 'no_such_name')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
