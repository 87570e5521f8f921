"""SmolLM2-135M-Instruct on the KV caches: in-loop quality, passkey retrieval, decode speed.

The measurement entry point; the model, caches and measurements live in the example
package ``examples/smollm2`` (benchmarks/studies/serving-smollm2.md). Run from the repository root:

    python -m benchmarks.smollm2 quality --cache tq:4/4 --windows 0,16,32,64,128,256
    python -m benchmarks.smollm2 passkey --cache tq:4/4 --cache tq:turbo-3.5
    python -m benchmarks.smollm2 speed --cache tq:4/4

(the same as ``python -m examples.smollm2 ...``). Each writes a markdown report recording
the commit and the command under ``tq-jax-results/`` in the current directory; ``--out -``
prints it only, and ``--out benchmarks/results/<file>.md`` refreshes a committed result.
"""

from examples.smollm2.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
