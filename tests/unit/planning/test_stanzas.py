import numpy as np

from warmup_tools.planning.stanzas import (
    BEGIN_MARKER,
    WarmupInput,
    WarmupSample,
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
    assert 'dims: [ 2 ]' in first and 'input_data_file: "wt_s1__text_input"' in first
    write_model_warmup(model, samples)
    assert (model / "config.pbtxt").read_text() == first
    assert sorted(p.name for p in (model / "warmup").iterdir()) == ["wt_s1__ids", "wt_s1__text_input"]
    # New samples replace the old block and remove stale data files.
    write_model_warmup(model, [WarmupSample("s2", (string_input("text_input", "bye"),))])
    text = (model / "config.pbtxt").read_text()
    assert text.count(BEGIN_MARKER) == 1 and '"s1"' not in text and '"s2"' in text
    assert sorted(p.name for p in (model / "warmup").iterdir()) == ["wt_s2__text_input"]
