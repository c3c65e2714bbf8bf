"""bench/data/build_text_dataset.py: a tiny dataset built by the script (its command line, on a
`_sources` folder holding this repository's own docs) reads back through Megatron's
IndexedDataset as the documents' tokens, and Megatron's GPTDataset draws training samples from
it as pretrain_gpt.py would (`--data-path P --split 100,0,0 --tokenizer-type NullTokenizer`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "data"))

import build_text_dataset  # noqa: E402

DOCS = ("README.md", "docs/DESIGN.md", "bench/results/README.md")


@pytest.fixture
def source(tmp_path):
    """A Sphinx-like tree: `_sources/*.rst.txt` (one heading underline added, which the script
    leaves out), and a link to the folder as Debian's package has (read once, not twice)."""
    folder = tmp_path / "root" / "html" / "_sources"
    folder.mkdir(parents=True)
    for i, name in enumerate(DOCS):
        text = open(os.path.join(ROOT, name), encoding="utf-8").read()
        (folder / f"doc{i}.rst.txt").write_text(f"Title\n=====\n{text}", encoding="utf-8")
    (tmp_path / "root" / "again").symlink_to(tmp_path / "root" / "html")
    return tmp_path / "root"


def _expected(i: int) -> str:
    return ("Title\n" + open(os.path.join(ROOT, DOCS[i]), encoding="utf-8").read()).strip()


def _read_back(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def test_bytes_dataset_reads_back_as_the_documents_utf8(source, tmp_path):
    prefix = str(tmp_path / "out" / "bytes")
    subprocess.run(
        [
            sys.executable,
            "bench/data/build_text_dataset.py",
            "--source",
            str(source),
            "--tokenizer",
            "bytes",
            "--out",
            prefix,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    info = json.load(open(prefix + ".json"))
    data = _read_back(prefix)
    assert len(data) == len(DOCS) == info["documents"]
    assert list(data.document_indices) == list(range(len(DOCS) + 1))
    for i in range(len(DOCS)):
        ids = data[i]
        assert ids.dtype == numpy.uint16 and ids[-1] == 256
        assert bytes(ids[:-1].astype(numpy.uint8)).decode("utf-8") == _expected(i)
    assert info["tokens"] == int(data.sequence_lengths.sum()) and info["vocab_size"] == 257
    assert info["bin_bytes"] == os.path.getsize(prefix + ".bin") == 2 * info["tokens"]


def test_bpe_dataset_decodes_to_the_documents_and_feeds_gptdataset(source, tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    prefix = str(tmp_path / "bpe")
    info = build_text_dataset.build(str(source), prefix, tokenizer="bpe", vocab_size=600)
    assert info["vocab_size"] == 600 and info["documents"] == len(DOCS)
    data = _read_back(prefix)
    model = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
    for i in range(len(DOCS)):
        ids = data[i].tolist()
        assert ids[-1] == info["eod_id"] == model.eos_id() and max(ids) < 600
        assert model.decode(ids[:-1]) == _expected(i)
    assert info["tokens"] < 0.7 * sum(len(_expected(i).encode()) for i in range(len(DOCS)))  # BPE merges

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    seq, vocab = 128, 151936  # the Qwen3 slice's vocab: the dataset's 600 ids leave rows unused
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=NullTokenizer(vocab),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [3 * info["tokens"] // seq, None, None], lambda: True, config
    ).build()
    assert valid is None and test is None and len(train) >= 3 * info["tokens"] // seq  # epochs repeat
    stream = numpy.concatenate([data[i] for i in range(len(DOCS))]).astype(numpy.int64).tobytes()
    for index in (0, 1, len(train) - 1):
        sample = train[index]
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        assert tokens.shape == labels.shape == (seq,) and (tokens[1:] == labels[:-1]).all()
        assert sample["loss_mask"].all()
        # A sample packs pieces of shuffled documents: each piece, cut after an end-of-document id,
        # is a run of one document's tokens.
        text = numpy.append(tokens, labels[-1])
        cuts = [0] + [i + 1 for i in numpy.flatnonzero(text == info["eod_id"])] + [len(text)]
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        assert len(pieces) >= 1 and all(_occurs(piece, stream) for piece in pieces)


def _occurs(piece, stream: bytes) -> bool:
    """Whether the int64 tokens `piece` appear in `stream` (int64 bytes) at a token boundary."""
    needle, start = piece.astype(numpy.int64).tobytes(), 0
    while (found := stream.find(needle, start)) >= 0:
        if found % 8 == 0:
            return True
        start = found + 1
    return False


def test_bad_arguments_name_the_field(source, tmp_path):
    with pytest.raises(ValueError, match="tokenizer='words'"):
        build_text_dataset.build(str(source), str(tmp_path / "x"), tokenizer="words")
    with pytest.raises(ValueError, match="vocab_size=70000"):
        build_text_dataset.build(str(source), str(tmp_path / "x"), vocab_size=70000)
    with pytest.raises(ValueError, match="no _sources"):
        build_text_dataset.build(str(tmp_path / "empty"), str(tmp_path / "x"))
