import re

import numpy as np
import pytest

from warmup_tools.planning.stanzas import (
    BEGIN_MARKER,
    WarmupInput,
    WarmupSample,
    data_file_name,
    deserialize_tensor,
    serialize_tensor,
    string_input,
    write_model_warmup,
)

CONFIG = 'name: "m"\nbackend: "python"\nmax_batch_size: 0\n'


def test_string_tensor_is_length_prefixed_little_endian():
    data = serialize_tensor(np.array([b"ab", "é".encode()], dtype=object), "TYPE_STRING")
    assert data == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xc3\xa9"
    back = deserialize_tensor(data, "TYPE_STRING", [2])
    assert list(back) == [b"ab", "é".encode()]


def test_numeric_round_trip():
    array = np.array([1, 2, 70000], dtype=np.int32)
    assert np.array_equal(deserialize_tensor(serialize_tensor(array, "TYPE_INT32"), "TYPE_INT32", [3]), array)


def test_write_is_idempotent_and_keeps_the_rest_of_the_config(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.pbtxt").write_text(CONFIG)
    samples = [WarmupSample("s1", (string_input("text_input", "hello"),
                                   WarmupInput("ids", "TYPE_INT32", np.array([1, 2], dtype=np.int32))))]
    write_model_warmup(model, samples)
    first = (model / "config.pbtxt").read_text()
    assert first.startswith(CONFIG)
    assert first.count(BEGIN_MARKER) == 1
    names = lambda: sorted(p.name for p in (model / "warmup").iterdir())  # noqa: E731
    text_file, ids_file = data_file_name(samples[0], samples[0].inputs[0]), data_file_name(samples[0],
                                                                                           samples[0].inputs[1])
    assert 'dims: [ 2 ]' in first and f'input_data_file: "{text_file}"' in first
    assert text_file.startswith("wt_s1__") and text_file.endswith("__text_input")
    write_model_warmup(model, samples)
    assert (model / "config.pbtxt").read_text() == first
    assert names() == sorted([ids_file, text_file])
    # New samples replace the old block and remove stale data files.
    write_model_warmup(model, [WarmupSample("s2", (string_input("text_input", "bye"),))])
    text = (model / "config.pbtxt").read_text()
    assert text.count(BEGIN_MARKER) == 1 and '"s1"' not in text and '"s2"' in text
    assert len(names()) == 1 and names()[0].startswith("wt_s2__")


def test_an_interrupted_rewrite_leaves_a_config_whose_files_all_exist(tmp_path, monkeypatch):
    import warmup_tools.planning.stanzas as stanzas

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.pbtxt").write_text(CONFIG)
    old = [WarmupSample("s1", (string_input("text_input", "hello"),))]
    write_model_warmup(model, old)
    before = (model / "config.pbtxt").read_text()
    real = stanzas.write_atomic

    def crash_on_config(path, data, **kw):
        if path.name == "config.pbtxt":
            raise OSError("disk full")
        real(path, data, **kw)

    monkeypatch.setattr(stanzas, "write_atomic", crash_on_config)
    # Same sample name, other content: the new data file must not overwrite the one the config names.
    with pytest.raises(OSError):
        write_model_warmup(model, [WarmupSample("s1", (string_input("text_input", "a longer text"),))])
    assert (model / "config.pbtxt").read_text() == before
    named = re.findall(r'input_data_file: "([^"]+)"', before)
    assert named and all((model / "warmup" / n).read_bytes() == serialize_tensor(
        np.array([b"hello"], dtype=object), "TYPE_STRING") for n in named)
