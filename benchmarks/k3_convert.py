"""llama.cpp's own converter (`convert_hf_to_gguf.py` of a llama.cpp tree, its `conversion/kimi_k3.py` and gguf-py)
run on a K3 twin, with the two workarounds a twin needs and nothing else changed:

- config.json is read as plain JSON: transformers has no `kimi_k3` config class to read it with;
- the vocabulary is a synthetic gpt2-style one of exactly vocab_size tokens: 256 byte tokens, then BPE merges (the
  loader refuses a BPE vocabulary without one), fillers, and Kimi's 256-id control block at the end. The converter
  cannot read the twin's tiktoken vocabulary (it needs Kimi's remote tokenizer code); the goldens feed token ids, so
  no text is ever tokenized.

    python benchmarks/k3_convert.py LLAMA_CPP_TREE MODEL_DIR --outfile twin.gguf --outtype f32

Run as its own process: the converter keeps module-level state and reads sys.argv.
"""

import json
import sys
from pathlib import Path

SPECIAL_BLOCK = 256  # Kimi's control tokens: the last 256 ids


def synthetic_vocab(vocab_size: int) -> tuple[list[str], list[str], list[bool]]:
    """(tokens, merges, is_control) for a gpt2-style byte-level BPE of exactly vocab_size tokens."""
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    merges = []
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    space = byte_chars[ord(" ")]
    for a in letters:  # ' a' .. ' z', then 'aa' .. 'zz': enough real merges to exercise the BPE loader
        tokens.append(space + a)
        merges.append(f"{space} {a}")
    for a in letters:
        for b in letters:
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    first_special = vocab_size - SPECIAL_BLOCK
    if len(tokens) > first_special:
        raise ValueError(f"vocab_size {vocab_size} is too small for the synthetic vocabulary")
    tokens += [f"<fill_{i}>" for i in range(len(tokens), first_special)]
    tokens += [f"<|reserved_token_{i}|>" for i in range(first_special, vocab_size)]
    return tokens, merges, [i >= first_special for i in range(vocab_size)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def main(argv: list[str]) -> None:
    tree = Path(argv[1]).resolve()
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import convert_hf_to_gguf  # the tree's own converter: importable once the tree is on the path
    import gguf
    from conversion.base import ModelBase
    from conversion.kimi_k3 import KimiK3Model

    def load_hparams(dir_model, is_mistral_format=False):
        return json.loads((Path(dir_model) / "config.json").read_text())

    def set_vocab(self):
        hp = self.hparams
        tokens, merges, control = synthetic_vocab(int(hp["vocab_size"]))
        normal, ctl = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("kimi-k2")
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types([ctl if c else normal for c in control])
        self.gguf_writer.add_token_merges(merges)
        self.gguf_writer.add_bos_token_id(int(hp["bos_token_id"]))
        self.gguf_writer.add_eos_token_id(int(hp["eos_token_id"]))
        self.gguf_writer.add_pad_token_id(int(hp["pad_token_id"]))
        self.gguf_writer.add_add_bos_token(False)

    ModelBase.load_hparams = staticmethod(load_hparams)
    KimiK3Model.set_vocab = set_vocab
    sys.argv = [str(tree / "convert_hf_to_gguf.py"), *argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv)
