"""Build a Megatron indexed dataset (.bin/.idx) of real English text for the end-to-end benchmarks.

    python bench/data/build_text_dataset.py [--source DIR | --deb FILE.deb | --apt python3.11-doc]
        [--tokenizer bpe|bytes] [--vocab-size 32000] [--out .gpu/data/pydoc]

The text: the reStructuredText sources of Python's documentation (`html/_sources/**/*.rst.txt`,
about 12 MB of English prose with code examples), as Debian ships them in `python3.11-doc`
(bookworm; `apt-get download python3.11-doc` fetches the .deb without installing it, --apt does
that here). Licence: the Python documentation is under the PSF License Agreement (version 2),
its code examples also under the Zero-Clause BSD licence (Debian's copyright file of the
package, `/usr/share/doc/python3.11-doc/copyright`). Each source file is one document; the lines
that only underline an rST heading (a run of one punctuation character) are left out.

Tokenizers (no download, both on the CPU machine): `bpe` trains a SentencePiece BPE model of
--vocab-size pieces on the same text (`sentencepiece` from PyPI, bench/requirements.txt; the
model is written beside the dataset as OUT.model) and ends each document with its EOS id;
`bytes` takes the UTF-8 bytes (ids 0-255) and ends each document with 256 (vocab 257).
Writes OUT.bin and OUT.idx (Megatron's IndexedDatasetBuilder, uint16 ids) and OUT.json (source,
licence, tokenizer, vocab, token and document counts, the Megatron flags to use). The GPU run
then needs `--data-path OUT --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size V` with V
at least the tokenizer's vocab (a larger V, such as the model's own vocab, leaves rows unused).
About 3 M tokens with `bpe` at 32000 (6 MB); Megatron repeats epochs as the run needs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy

SOURCES_GLOB = os.path.join("**", "_sources", "**", "*.rst.txt")
LICENCE = (
    "PSF License Agreement version 2 (Python documentation); code examples also Zero-Clause BSD; "
    "Debian package python3.11-doc, /usr/share/doc/python3.11-doc/copyright"
)
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+.:_])\1{3,}\s*$")


def read_documents(source: str, max_documents: int | None = None) -> list[str]:
    """The documents under `source`: one per `*.rst.txt` file below a `_sources` folder (sorted by
    path, so the order is the same on every machine), heading underlines left out.

    Arguments:
        source: a folder holding (at any depth) Sphinx's `_sources` folder.
        max_documents: keep only the first this many (a small dataset for tests).
    Returns:
        the documents' texts (empty ones dropped).
    """
    # The package links the same folder from several places: each file once, by its real path.
    paths = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(source, SOURCES_GLOB), recursive=True)})
    if not paths:
        raise ValueError(f"source {source!r} holds no _sources/**/*.rst.txt file (extract python3.11-doc there)")
    documents = []
    for path in paths[:max_documents]:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = "".join(line for line in f if not _UNDERLINE.match(line)).strip()
        if text:
            documents.append(text)
    return documents


def extract_deb(deb: str, dest: str) -> str:
    """Unpack a .deb's files into `dest` (dpkg-deb -x); returns `dest`."""
    subprocess.run(["dpkg-deb", "-x", deb, dest], check=True)
    return dest


def apt_download(package: str, dest: str) -> str:
    """`apt-get download PACKAGE` into `dest` (Debian's own client, no install); returns the .deb."""
    subprocess.run(["apt-get", "download", package], cwd=dest, check=True)
    debs = glob.glob(os.path.join(dest, f"{package}_*.deb"))
    if len(debs) != 1:
        raise RuntimeError(f"apt-get download {package} left {debs} in {dest}")
    return debs[0]


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, 256 ends a document."""

    vocab_size, eod = 257, 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class BpeTokenizer:
    """A SentencePiece BPE model trained on the documents themselves; its EOS id ends a document."""

    name = "sentencepiece-bpe"

    def __init__(self, documents: list[str], vocab_size: int, model_prefix: str):
        import sentencepiece

        # Lines as sentences; no normalisation, so code keeps its characters.
        sentences = (line for doc in documents for line in doc.splitlines() if line.strip())
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_prefix=model_prefix,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        os.remove(model_prefix + ".vocab")  # the pieces are in the model too
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_prefix + ".model")
        self.vocab_size, self.eod = self.processor.get_piece_size(), self.processor.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)


def write_dataset(documents: list[str], tokenizer, out_prefix: str) -> dict:
    """Tokenize `documents` and write `out_prefix`.bin/.idx with Megatron's IndexedDatasetBuilder
    (one sequence per document, ending with the tokenizer's end-of-document id).

    Returns:
        dict(tokens=..., documents=...).
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(out_prefix), dtype=DType.optimal_dtype(tokenizer.vocab_size))
    tokens = 0
    for text in documents:
        ids = tokenizer.encode(text) + [tokenizer.eod]
        builder.add_document(numpy.asarray(ids), [len(ids)])
        tokens += len(ids)
    builder.finalize(get_idx_path(out_prefix))
    return dict(tokens=tokens, documents=len(documents))


def build(
    source: str, out_prefix: str, tokenizer: str = "bpe", vocab_size: int = 32000, max_documents: int | None = None
) -> dict:
    """Read, tokenize and write the dataset; writes and returns its description (OUT.json).

    Arguments:
        source: folder with Sphinx `_sources` (see `read_documents`).
        out_prefix: path prefix of the .bin/.idx/.json (and .model for "bpe").
        tokenizer: "bpe" (SentencePiece, `vocab_size` pieces) or "bytes".
        vocab_size: pieces of the BPE model (at most 65500: the ids are stored as uint16).
        max_documents: keep the first this many documents.
    """
    if tokenizer not in ("bpe", "bytes"):
        raise ValueError(f"tokenizer={tokenizer!r}: allowed are 'bpe' and 'bytes'")
    if tokenizer == "bpe" and not 256 < vocab_size <= 65500:
        raise ValueError(f"vocab_size={vocab_size}: allowed 257 .. 65500 (uint16 ids, byte fallback)")
    documents = read_documents(source, max_documents)
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    tok = BpeTokenizer(documents, vocab_size, out_prefix) if tokenizer == "bpe" else ByteTokenizer()
    counts = write_dataset(documents, tok, out_prefix)
    info = dict(
        prefix=os.path.basename(out_prefix),
        source="Python 3.11 documentation, reStructuredText sources "
        "(Debian bookworm package python3.11-doc, html/_sources)",
        licence=LICENCE,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eod_id=tok.eod,
        **counts,
        bin_bytes=os.path.getsize(out_prefix + ".bin"),
        idx_bytes=os.path.getsize(out_prefix + ".idx"),
        megatron_flags=f"--data-path {out_prefix} --split 100,0,0 --tokenizer-type NullTokenizer "
        f"--vocab-size V (V >= {tok.vocab_size})",
    )
    with open(out_prefix + ".json", "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--source", help="folder with the extracted package (default /usr/share/doc/python3.11)")
    where.add_argument("--deb", help="the python3.11-doc .deb: unpacked to a temporary folder")
    where.add_argument("--apt", metavar="PACKAGE", help="`apt-get download PACKAGE` (e.g. python3.11-doc) first")
    parser.add_argument("--tokenizer", default="bpe", choices=("bpe", "bytes"))
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--out", default=".gpu/data/pydoc", help="path prefix of the dataset (git ignores .gpu/)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source or "/usr/share/doc/python3.11"
        if args.apt:
            args.deb = apt_download(args.apt, tmp)
        if args.deb:
            source = extract_deb(args.deb, os.path.join(tmp, "root"))
        info = build(source, args.out, args.tokenizer, args.vocab_size, args.max_documents)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    sys.exit(main())
