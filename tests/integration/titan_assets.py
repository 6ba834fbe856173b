"""Offline test assets for torchtitan 0.3.0's ``llama3_debugmodel``: a tokenizer and a ``c4_test`` set.

The torchtitan wheel ships neither; its repository's ``tests/assets/`` has them, but a CI machine
that reaches only PyPI cannot fetch a repository. ``write_assets(dest_dir)`` builds both from
nothing, with the standard library only (no ``tokenizers``, no ``datasets``, no network), the same
bytes on every call (fixed seed, sorted keys, tie-broken merges):

``dest_dir/tokenizer/``
    ``tokenizer.json``: a byte-level BPE (GPT-2 byte alphabet, 256 base symbols) with merges
    learnt here by a small BPE over the generated text, plus two special tokens,
    ``<|begin_of_text|>`` and ``<|end_of_text|>``. ``tokenizer_config.json`` names them as
    ``bos_token``/``eos_token``, which is what ``torchtitan.components.tokenizer.
    HuggingFaceTokenizer`` reads (``_load_tokenizer_from_path`` takes ``tokenizer.json`` first;
    ``_infer_special_tokens`` takes the BOS/EOS ids from ``tokenizer_config.json``). The whole
    vocabulary (``VOCAB_SIZE`` = 1024) stays below the debug model's 2048 embeddings.
``dest_dir/c4_test/data.json``
    JSON lines ``{"text", "timestamp", "url"}``, the layout of the repository's
    ``tests/assets/c4_test``: torchtitan's ``c4_test`` entry calls
    ``datasets.load_dataset(path, split="train")`` on the folder, which picks the json builder and
    reads the ``text`` field (``torchtitan/hf_datasets/text_datasets.py``).

torchtitan's ``llama3_debugmodel`` defaults are ``hf_assets_path="./tests/assets/tokenizer"`` and
the ``c4_test`` path ``tests/assets/c4_test``, both relative to the working directory: write the
assets to ``<cwd>/tests/assets`` and no flag is needed, or pass ``--hf-assets-path`` and
``--dataloader.dataset-path`` (the returned dict has both paths).

    python titan_assets.py DEST_DIR      # writes them and prints the dict as JSON
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
from collections import Counter

SEED = 20260
VOCAB_SIZE = 1024  # total ids, special tokens included; llama3 debugmodel has 2048 embeddings
N_DOCS = 256
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _documents(rng: random.Random) -> list[str]:
    """Pseudo-English documents: sentences of syllable words from a fixed lexicon, some numbers."""
    lexicon: list[str] = []
    while len(lexicon) < 400:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.3:
            word += rng.choice(_CONSONANTS)
        if word not in lexicon:
            lexicon.append(word)
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]  # Zipf-like, so BPE has frequent pairs
    docs = []
    for _ in range(N_DOCS):
        sentences = []
        for _ in range(rng.randint(3, 12)):
            words = rng.choices(lexicon, weights=weights, k=rng.randint(4, 16))
            if rng.random() < 0.2:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 2026)))
            sentence = " ".join(words)
            sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".....?!"))
        docs.append(" ".join(sentences))
    return docs


_PRETOKEN = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def _pretokens(text: str) -> list[str]:
    """GPT-2's ByteLevel split restricted to ASCII (the generated text is ASCII; training only)."""
    return _PRETOKEN.findall(text)


def _train_bpe(docs: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over unique pre-tokens; the most frequent pair wins, ties by the pair's order."""
    b2u = _bytes_to_unicode()
    counts = Counter(p for d in docs for p in _pretokens(d))
    words = [[b2u[b] for b in w.encode("utf-8")] for w in sorted(counts)]
    freqs = [counts[w] for w in sorted(counts)]
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for sym, f in zip(words, freqs):
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        for i, sym in enumerate(words):
            if len(sym) < 2:
                continue
            j, new = 0, []
            while j < len(sym):
                if j + 1 < len(sym) and sym[j] == best[0] and sym[j + 1] == best[1]:
                    new.append(joined)
                    j += 2
                else:
                    new.append(sym[j])
                    j += 1
            words[i] = new
    return merges


def _added(idx: int, content: str) -> dict:
    return {"id": idx, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def _tokenizer_json(merges: list[tuple[str, str]]) -> dict:
    vocab: dict[str, int] = {}
    for ch in sorted(_bytes_to_unicode().values()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    specials = [_added(len(vocab), BOS), _added(len(vocab) + 1, EOS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": [[a, b] for a, b in merges],
        },
    }


def _dump(path: str, obj, lines: bool = False) -> None:
    with open(path, "w", encoding="utf-8") as f:
        if lines:
            for row in obj:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        else:
            json.dump(obj, f, ensure_ascii=False, indent=1, sort_keys=False)
            f.write("\n")


def write_assets(dest_dir: str) -> dict:
    """Write ``tokenizer/`` and ``c4_test/`` under ``dest_dir``; return their paths and facts."""
    rng = random.Random(SEED)
    docs = _documents(rng)
    merges = _train_bpe(docs, VOCAB_SIZE - 256 - 2)
    tok = _tokenizer_json(merges)
    n_vocab = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    assert n_vocab <= VOCAB_SIZE, n_vocab

    tok_dir = os.path.join(dest_dir, "tokenizer")
    data_dir = os.path.join(dest_dir, "c4_test")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    _dump(os.path.join(tok_dir, "tokenizer.json"), tok)
    _dump(os.path.join(tok_dir, "tokenizer_config.json"), {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                 for t in tok["added_tokens"]},
    })
    rows = [{"text": d, "timestamp": f"2019-04-{1 + i % 28:02d}T00:00:00Z",
             "url": f"https://example.invalid/doc/{i}"} for i, d in enumerate(docs)]
    _dump(os.path.join(data_dir, "data.json"), rows, lines=True)

    digest = hashlib.sha256()
    for rel in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "c4_test/data.json"):
        with open(os.path.join(dest_dir, rel), "rb") as f:
            digest.update(f.read())
    return {
        "hf_assets_path": tok_dir,
        "dataset_path": data_dir,
        "vocab_size": n_vocab,
        "bos_id": tok["added_tokens"][0]["id"],
        "eos_id": tok["added_tokens"][1]["id"],
        "n_docs": len(docs),
        "n_chars": sum(len(d) for d in docs),
        "sha256": digest.hexdigest(),
    }


if __name__ == "__main__":
    print(json.dumps(write_assets(sys.argv[1] if len(sys.argv) > 1 else "tests/assets"), indent=1))
