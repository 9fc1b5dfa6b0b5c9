"""Make a servable folder for a model shape with random weights: the shape's config.json plus a synthetic
word-level tokenizer covering its whole vocabulary (no real tokenizer can be fetched here); its first ids
are the printable ASCII characters, so grammar-constrained requests can be benchmarked.

    python -m benchmarks.make_dummy_model llama-3.2-1b /tmp/llama-1b
    launch_server --model-path /tmp/llama-1b --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from model_executor.configs import SHAPES, shape_path

PRINTABLE = [chr(c) for c in range(33, 127)]


def make_dummy_model(shape: str, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(shape_path(shape) / "config.json", out / "config.json")
    config = json.loads((out / "config.json").read_text())
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    # Ids 1-94 are the printable ASCII characters (no space): grammars (JSON, regex) can then be spelled, so
    # structured-output benchmarks run on the dummy model too.
    for i, c in enumerate(PRINTABLE, start=1):
        del vocab[f"t{i}"]
        vocab[c] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"t{eos}", "unk_token": "t0",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.make_dummy_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=SHAPES)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(make_dummy_model(args.shape, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
