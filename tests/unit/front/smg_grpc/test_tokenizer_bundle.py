"""GetTokenizer's zip: the tokenizer files at the root, deterministic, chunked, the digest on the last chunk."""

import hashlib
import io
import os
import zipfile

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.front.smg_grpc.tokenizer_bundle import CHUNK_BYTES, TokenizerBundle


def test_the_demo_tokenizer_bundles_the_files_smg_reads(demo_assets):
    bundle = TokenizerBundle.from_folder(demo_assets.lm_dir)
    names = zipfile.ZipFile(io.BytesIO(bundle.data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names and "config.json" in names
    assert "model.safetensors" not in names
    assert TokenizerBundle.from_folder(demo_assets.lm_dir).data == bundle.data  # the same bytes every time
    assert bundle.sha256 == hashlib.sha256(bundle.data).hexdigest()


def test_chunks_are_bounded_and_only_the_last_carries_the_digest(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(os.urandom(3 * CHUNK_BYTES))  # incompressible
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "weights.bin").write_bytes(b"x")
    bundle = TokenizerBundle.from_folder(tmp_path)
    assert bundle.names == ("chat_template.jinja", "tokenizer.json")
    chunks = list(bundle.chunks())
    assert len(chunks) >= 4 and all(len(data) <= CHUNK_BYTES for data, _ in chunks)
    assert [digest for _, digest in chunks[:-1]] == [""] * (len(chunks) - 1) and chunks[-1][1] == bundle.sha256
    assert b"".join(data for data, _ in chunks) == bundle.data


def test_a_folder_without_a_tokenizer_or_with_a_fifo_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        TokenizerBundle.from_folder(tmp_path)
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="not bundled"):
        TokenizerBundle.from_folder(tmp_path)
