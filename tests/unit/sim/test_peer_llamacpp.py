"""bench peer's llama.cpp peer without a server: the build, conversion and server command lines, the request body
that picks an adapter, the pre-tokenizer name the converters are given, the table with two peers; and the demo
LM and an adapter converted to GGUF and read back (where llama.cpp's source and converters are installed)."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from warmup_tools.sim.bench.peer import Figures, format_table
from warmup_tools.sim.bench.support import peer_servers
from warmup_tools.sim.bench.support.llamacpp_convert import pre_tokenizer_name
from warmup_tools.sim.bench.support.peer_servers import (
    BASE,
    LLAMACPP_CONVERT,
    Gguf,
    LlamaCpp,
    convert_adapter_argv,
    convert_lm_argv,
    llamacpp_argv,
    llamacpp_body,
    llamacpp_build_argv,
    parse_peers,
)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_build_configures_a_native_cpu_release_without_curl_and_builds_only_llama_server(tmp_path):
    configure, build = llamacpp_build_argv(tmp_path / "src", tmp_path / "build")
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    assert {"-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"} <= set(configure)
    assert not any("CUDA" in a or "VULKAN" in a for a in configure)
    assert build == ["cmake", "--build", str(tmp_path / "build"), "--target", "llama-server", "-j", "2"]


def test_the_converters_run_through_the_pre_tokenizer_shim_at_float32(tmp_path):
    tools = LlamaCpp(tmp_path / "build" / "bin" / "llama-server", tmp_path / "venv" / "bin" / "python",
                     tmp_path / "llama.cpp")
    lm = convert_lm_argv(tools, tmp_path / "lm", tmp_path / "lm.gguf")
    assert lm[:4] == [str(tools.python), str(LLAMACPP_CONVERT), str(tools.source), "convert_hf_to_gguf.py"]
    assert lm[4] == str(tmp_path / "lm")
    assert _flag(lm, "--outtype") == "f32" and _flag(lm, "--outfile") == str(tmp_path / "lm.gguf")
    lora = convert_adapter_argv(tools, tmp_path / "adapters" / "sql", tmp_path / "lm", tmp_path / "sql.gguf")
    assert lora[3:5] == ["convert_lora_to_gguf.py", str(tmp_path / "adapters" / "sql")]
    assert _flag(lora, "--base") == str(tmp_path / "lm") and _flag(lora, "--outtype") == "f32"
    assert LLAMACPP_CONVERT.exists()


def test_llama_server_loads_every_adapter_unapplied_with_a_2048_token_slot_per_stream_and_one_thread(tmp_path):
    gguf = Gguf(tmp_path / "lm.gguf", {"legal": tmp_path / "legal.gguf", "sql": tmp_path / "sql.gguf"})
    argv = llamacpp_argv(tmp_path / "llama-server", gguf, threads=1, max_num_seqs=8, port=9)
    assert argv[0] == str(tmp_path / "llama-server") and _flag(argv, "--model") == str(tmp_path / "lm.gguf")
    assert _flag(argv, "--host") == "127.0.0.1" and _flag(argv, "--port") == "9"
    assert _flag(argv, "--threads") == "1" and _flag(argv, "--threads-batch") == "1"
    assert _flag(argv, "--parallel") == "8" and _flag(argv, "--ctx-size") == str(8 * 2048)
    assert _flag(argv, "--cache-type-k") == "f32" and _flag(argv, "--cache-type-v") == "f32"  # the project's KV
    assert int(_flag(argv, "--cache-ram")) > 0  # its host-RAM prompt cache
    # one list (a repeated --lora keeps only the last one), ids in this order, scale 0 unless a request says
    assert _flag(argv, "--lora-scaled") == f"{tmp_path / 'legal.gguf'}:0,{tmp_path / 'sql.gguf'}:0"
    assert "--lora" not in argv and "--lora-init-without-apply" in argv and "--slot-save-path" not in argv
    saving = llamacpp_argv(tmp_path / "llama-server", gguf, threads=2, max_num_seqs=1, port=9,
                           slot_save_path=tmp_path / "slots")
    assert _flag(saving, "--slot-save-path") == str(tmp_path / "slots") and _flag(saving, "--ctx-size") == "2048"
    bare = llamacpp_argv(tmp_path / "llama-server", Gguf(tmp_path / "lm.gguf", {}), threads=1, max_num_seqs=1,
                         port=9)
    assert "--lora-scaled" not in bare and "--lora-init-without-apply" not in bare
    with pytest.raises(ValueError, match="has ',' or ':'"):
        llamacpp_argv(tmp_path / "llama-server", Gguf(tmp_path / "lm.gguf", {"x": tmp_path / "a,b.gguf"}),
                      threads=1, max_num_seqs=1, port=9)


def test_a_request_names_every_adapters_scale_so_a_slot_never_keeps_the_last_ones():
    adapters = ["legal", "sql", "support"]
    assert llamacpp_body(adapters, "sql") == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0},
                                                       {"id": 2, "scale": 0.0}]}
    assert llamacpp_body(adapters, BASE) == {"lora": [{"id": i, "scale": 0.0} for i in range(3)]}
    with pytest.raises(ValueError, match="no adapter 'nope'.*legal, sql, support"):
        llamacpp_body(adapters, "nope")


def test_the_demo_tokenizer_is_named_gpt2_and_any_other_pre_tokenizer_stays_unknown(demo_assets, tmp_path):
    assert pre_tokenizer_name(demo_assets.lm_dir) == "gpt-2"
    spec = json.loads((demo_assets.lm_dir / "tokenizer.json").read_text())
    changes = {
        "prefix space": lambda s: s["pre_tokenizer"].update(add_prefix_space=True),
        "no regex": lambda s: s["pre_tokenizer"].update(use_regex=False),
        "a normalizer": lambda s: s.update(normalizer={"type": "NFC"}),
        "another pre-tokenizer": lambda s: s.update(pre_tokenizer={"type": "Metaspace"}),
        "not BPE": lambda s: s["model"].update(type="Unigram"),
    }
    for name, change in changes.items():
        other = copy.deepcopy(spec)
        change(other)
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps(other))
        assert pre_tokenizer_name(folder) is None, name
    assert pre_tokenizer_name(tmp_path / "missing") is None


def test_the_shim_refuses_a_script_it_does_not_know(tmp_path):
    from warmup_tools.sim.bench.support import llamacpp_convert

    with pytest.raises(SystemExit, match="usage"):
        llamacpp_convert.main([str(tmp_path), "convert_anything.py"])


def test_peers_are_a_comma_list_of_known_names():
    assert parse_peers("vllm,llamacpp") == ("vllm", "llamacpp")
    assert parse_peers(" llamacpp , llamacpp") == ("llamacpp",)
    for bad in ("vllm,ollama", "", " , "):
        with pytest.raises(ValueError, match="each must be one of vllm, llamacpp"):
            parse_peers(bad)


def test_the_table_gives_the_project_against_each_peer_with_its_ratio():
    project = Figures(300.0, 50.0, 40.0, 60.0, 200.0, 500.0, 512)
    vllm = Figures(200.0, 25.0, 40.0, 90.0, 400.0, 250.0, 512)
    llamacpp = Figures(600.0, 100.0, 20.0, 30.0, 100.0, 1000.0, 511)
    results = {BASE: {"project": project, "vllm": vllm, "llamacpp": llamacpp},
               "sql": {"project": project, "vllm": vllm, "llamacpp": llamacpp}}
    table = format_table(results, streams=8, threads=1, versions={"vllm": "0.32.0", "llamacpp": "commit 0c1e570"},
                         theirs=("vllm", "llamacpp"))
    lines = table.strip().splitlines()
    assert lines[0] == ("bench peer: this project / vLLM 0.32.0 / llama.cpp commit 0c1e570, 1 LM thread(s) each, "
                        "medians")
    assert lines[1] == ("| | base model: project / vLLM (ratio) / llama.cpp (ratio) "
                        "| sql: project / vLLM (ratio) / llama.cpp (ratio) |")
    assert lines[2] == "|---|---|---|"
    assert ("| TTFT, new 512-token prefix + 16 (cold), ms | 300 / 200 (1.50) / 600 (0.50) "
            "| 300 / 200 (1.50) / 600 (0.50) |") in lines
    assert "| output tokens/s, 8 streams | 200 / 400 (0.50) / 100 (2.00) | 200 / 400 (0.50) / 100 (2.00) |" in lines
    assert lines[-1] == "| cached prompt tokens of the warm request | 512 / 512 / 511 | 512 / 512 / 511 |"
    alone = format_table({BASE: {"project": project, "llamacpp": llamacpp}}, streams=8, threads=1,
                         versions={"llamacpp": "commit 0c1e570"}, theirs=("llamacpp",)).strip().splitlines()
    assert alone[1] == "| | base model: project / llama.cpp (ratio) |"


def test_the_version_is_the_commit_the_sdist_tree_was_noted_at(tmp_path):
    server = tmp_path / "build" / "bin" / "llama-server"
    assert peer_servers.llamacpp_version(server) == "unknown commit"
    (tmp_path / "COMMIT").write_text("0c1e57098bba43ac29e6e3b677cdceebdd22334f\n")
    assert peer_servers.llamacpp_version(server) == "commit 0c1e57098bba"


# --- the real converters (installed by ensure_llamacpp; a 76 MB sdist and a virtualenv with torch) ---

def _installed() -> LlamaCpp | None:
    root = peer_servers.LLAMACPP_DIR
    tools = LlamaCpp(root / "build" / "bin" / "llama-server", root / "venv" / "bin" / "python", root / "llama.cpp")
    ready = tools.python.exists() and (tools.source / "convert_hf_to_gguf.py").exists()
    return tools if ready else None


_READ_BACK = """
import json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
fields = {}
for k, f in r.fields.items():
    if k.startswith("GGUF."):
        continue
    v = f.contents()
    fields[k] = len(v) if isinstance(v, list) and len(v) > 16 else v
print(json.dumps({"fields": fields, "tensors": {t.name: [t.tensor_type.name, [int(d) for d in t.shape]]
                                                 for t in r.tensors}}))
"""


def _read_back(tools: LlamaCpp, path: Path) -> dict:
    return json.loads(subprocess.run([str(tools.python), "-c", _READ_BACK, str(path)], capture_output=True,
                                     text=True, check=True).stdout)


@pytest.mark.timeout(600)
def test_the_demo_lm_and_an_adapter_convert_to_float32_gguf_with_the_same_shapes_and_tokenizer(demo_assets,
                                                                                              tmp_path):
    tools = _installed()
    if tools is None:
        pytest.skip(f"llama.cpp's converters are not installed in {peer_servers.LLAMACPP_DIR} (`bench peer "
                    f"--peers llamacpp` installs them: a 76 MB sdist and a virtualenv with torch)")
    import io

    from safetensors import safe_open

    assets = tmp_path / "assets"
    (assets / "adapters").mkdir(parents=True)
    (assets / "lm").symlink_to(demo_assets.lm_dir)
    (assets / "adapters" / "sql").symlink_to(demo_assets.adapter_root / "sql")
    gguf = peer_servers.ensure_gguf(tools, assets, tmp_path / "gguf", io.StringIO())
    assert list(gguf.adapters) == ["sql"]

    lm = _read_back(tools, gguf.lm)
    config = json.loads((demo_assets.lm_dir / "config.json").read_text())
    f = lm["fields"]
    assert f["general.architecture"] == "llama" and f["general.file_type"] == 0  # 0: all float32
    assert f["llama.block_count"] == config["num_hidden_layers"]
    assert f["llama.embedding_length"] == config["hidden_size"]
    assert f["llama.attention.head_count_kv"] == config["num_key_value_heads"]
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.tokens"] == config["vocab_size"]
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"]) == (config["bos_token_id"],
                                                                                     config["eos_token_id"])
    assert not f.get("tokenizer.ggml.add_bos_token")  # the project adds no BOS either
    tensors = lm["tensors"]
    assert {t for t, _ in tensors.values()} == {"F32"}
    with safe_open(str(demo_assets.lm_dir / "model.safetensors"), "pt") as st:
        assert len(tensors) == len(list(st.keys()))
        q = st.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
    assert tensors["blk.0.attn_q.weight"][1] == q[::-1]  # GGUF lists dimensions innermost first
    assert tensors["token_embd.weight"][1] == [config["hidden_size"], config["vocab_size"]]

    lora = _read_back(tools, gguf.adapters["sql"])
    adapter = json.loads((demo_assets.adapter_root / "sql" / "adapter_config.json").read_text())
    assert lora["fields"]["general.type"] == "adapter" and lora["fields"]["adapter.type"] == "lora"
    assert lora["fields"]["adapter.lora.alpha"] == adapter["lora_alpha"]
    modules = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    expected = {f"blk.{i}.{modules[m]}.weight.lora_{ab}" for i in range(config["num_hidden_layers"])
                for m in adapter["target_modules"] for ab in "ab"}
    assert set(lora["tensors"]) == expected
    assert {t for t, _ in lora["tensors"].values()} == {"F32"}
    assert lora["tensors"]["blk.0.attn_q.weight.lora_a"][1] == [config["hidden_size"], adapter["r"]]

    again = peer_servers.ensure_gguf(tools, assets, tmp_path / "gguf", io.StringIO())  # converted once
    assert again == gguf and gguf.lm.stat().st_mtime_ns == again.lm.stat().st_mtime_ns


def _tar(path: Path, members: dict[str, bytes | str]) -> Path:
    """A .tar.gz of regular files (bytes) and symbolic links (str: the target)."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return path


def test_only_the_vendored_tree_and_its_commit_come_out_of_the_sdist_and_never_a_link(tmp_path):
    import tarfile

    sdist = _tar(tmp_path / "p.tar.gz", {
        "p-1/vendor/llama.cpp/convert_hf_to_gguf.py": b"# converter",
        "p-1/vendor/llama.cpp/passwd": "/etc/passwd",
        "p-1/.git/modules/vendor/llama.cpp/HEAD": b"0c1e570\n",
        "p-1/setup.py": b"# not llama.cpp",
    })
    peer_servers._extract_vendored(sdist, tmp_path / "x")
    files = sorted(str(p.relative_to(tmp_path / "x")) for p in (tmp_path / "x").rglob("*") if p.is_file())
    assert files == ["p-1/.git/modules/vendor/llama.cpp/HEAD", "p-1/vendor/llama.cpp/convert_hf_to_gguf.py"]
    assert not (tmp_path / "x" / "p-1" / "vendor" / "llama.cpp" / "passwd").exists()
    escaping = _tar(tmp_path / "e.tar.gz", {"p-1/vendor/llama.cpp/../../../../escaped.txt": b"x"})
    with pytest.raises(tarfile.OutsideDestinationError):
        peer_servers._extract_vendored(escaping, tmp_path / "y")
    assert not (tmp_path / "escaped.txt").exists()


def test_a_request_whose_kept_alive_connection_closed_unanswered_is_sent_once_more(monkeypatch):
    # The real thing: tests/integration/test_bench_peer_llamacpp.py drives llama-server through this client.
    import httpx

    from warmup_tools.sim.bench import peer
    from warmup_tools.sim.bench.support.openai_stream import Streamed

    calls = []

    def flaky(client, url, body):
        calls.append(body)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return Streamed(0.01, 0.02, {"prompt_tokens": 5, "completion_tokens": 2})

    monkeypatch.setattr(peer, "stream_completion", flaky)
    with peer.OpenAIStreams("http://127.0.0.1:9", fields=lambda model: {"lora": [{"id": 0, "scale": 1.0}]}) as c:
        sample = c.complete("sql", "hello", 2)
        assert c.resent == 1 and sample.output_tokens == 2 and calls[0] == calls[1]
        assert calls[0]["lora"] == [{"id": 0, "scale": 1.0}] and calls[0]["ignore_eos"] is True

        def broken(client, url, body):
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

        monkeypatch.setattr(peer, "stream_completion", broken)
        with pytest.raises(httpx.RemoteProtocolError):  # a stream cut short is not sent again
            c.complete("sql", "hello", 2)
        assert c.resent == 1
