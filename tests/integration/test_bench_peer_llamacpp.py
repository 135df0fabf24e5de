"""llama.cpp's ``llama-server`` as bench peer runs it, on the demo LM and adapters converted to GGUF: it tokenizes
as the project does, picks the adapter a request names, reports cached prompt tokens the way the client reads
them, and saves and restores a slot. Skipped where ``bench peer --peers llamacpp`` has not built llama.cpp (a
76 MB sdist, a 15-minute build on two cores: too long for a test to make)."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import httpx
import pytest

from warmup_tools.common.errors import ServerError
from warmup_tools.sim.bench.peer import OpenAIStreams, Prompts, measure
from warmup_tools.sim.bench.support import peer_servers
from warmup_tools.sim.bench.support.peer_servers import BASE, LlamaCpp, llamacpp_body

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def llamacpp(demo_assets, tmp_path_factory):
    root = peer_servers.LLAMACPP_DIR
    tools = LlamaCpp(root / "build" / "bin" / "llama-server", root / "venv" / "bin" / "python", root / "llama.cpp")
    if not (tools.server.exists() and tools.python.exists()):
        pytest.skip(f"llama.cpp is not built in {root} (`python -m warmup_tools bench peer --peers llamacpp` "
                    f"builds it)")
    gguf = peer_servers.ensure_gguf(tools, demo_assets.root, tmp_path_factory.mktemp("gguf"), io.StringIO())
    slots = tmp_path_factory.mktemp("slots")
    log = tmp_path_factory.mktemp("logs") / "llamacpp.log"
    with peer_servers.llamacpp_server(tools.server, gguf, threads=1, max_num_seqs=2, log=log,
                                      slot_save_path=slots) as url:
        yield url, list(gguf.adapters)


def test_llama_server_tokenizes_bench_prompts_and_real_traffic_as_the_project_does(llamacpp, demo_assets):
    from warmup_tools.common.records import read_request_log
    from warmup_tools.common.tokenizer import load_tokenizer
    from warmup_tools.sim.real_traffic import RealTrafficConfig, write_real_logs

    url, _ = llamacpp
    tokenizer = load_tokenizer(demo_assets.lm_dir)
    prompts = Prompts(demo_assets.lm_dir, seed=3)
    texts = [prompts.text(n) for n in (16, 64, 512)]
    with tempfile.TemporaryDirectory() as tmp:
        day1 = write_real_logs(RealTrafficConfig(seed=0, requests_per_day=200), Path(tmp))[0]
        texts += list(dict.fromkeys(r.prompt for r in read_request_log([day1]) if r.prompt))[:60]
    texts += ["tabs\t\tand\n\nnew lines  ", "don't  won't   can't", "3.14 1234567 émigré 😶\u200d🌫️ 我想", " "]
    with httpx.Client(base_url=url, timeout=120) as client:
        for text in texts:
            theirs = client.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
            assert theirs == tokenizer.encode(text, add_special_tokens=True), text[:80]


def test_a_request_picks_its_adapter_and_the_next_one_on_that_slot_gets_the_base_model_back(llamacpp, demo_assets):
    url, adapters = llamacpp
    prompt = Prompts(demo_assets.lm_dir, seed=4).text(32)

    def greedy(model: str) -> list[int]:
        body = {"prompt": prompt, "n_predict": 8, "temperature": 0.0, "ignore_eos": True, "return_tokens": True,
                "id_slot": 0, **llamacpp_body(adapters, model)}
        return httpx.post(f"{url}/completion", json=body, timeout=120).json()["tokens"]

    base, sql, base_again = greedy(BASE), greedy("sql"), greedy(BASE)
    assert len(base) == 8 and sql != base and base_again == base


def test_the_client_reads_llama_cpps_usage_its_cached_prompt_tokens_and_ignore_eos(llamacpp, demo_assets):
    from warmup_tools.common.tokenizer import load_tokenizer

    url, adapters = llamacpp
    tokenizer = load_tokenizer(demo_assets.lm_dir)
    prompts = Prompts(demo_assets.lm_dir, seed=5)
    prefix = prompts.text(256)
    first, second = f"{prefix} {prompts.text(16)}", f"{prefix} {prompts.text(16)}"
    with OpenAIStreams(url, fields=lambda model: llamacpp_body(adapters, model)) as client:
        cold = client.complete("sql", first, 6)
        warm = client.complete("sql", second, 6)
    assert cold.prompt_tokens == len(tokenizer.encode(first)) and cold.output_tokens == 6  # ignore_eos
    assert cold.cached_tokens == 0 and warm.cached_tokens >= 256 and warm.output_tokens == 6


def test_every_phase_gives_every_figure_against_llama_cpp(llamacpp, demo_assets):
    url, adapters = llamacpp
    prompts = Prompts(demo_assets.lm_dir, seed=6)
    servers = {"llamacpp": OpenAIStreams(url, fields=lambda model: llamacpp_body(adapters, model))}
    try:
        figures = measure(servers, "sql", prompts, repeats=1, streams=2, stream_requests=1, max_tokens=4)
    finally:
        servers["llamacpp"].close()
    f = figures["llamacpp"]
    assert f.cold_ttft_ms > 0 and f.one_stream_tps > 0 and f.streams_tps > 0 and f.cached_tokens_warm > 0


def test_a_slot_saved_to_disk_restores_into_another_slot_and_serves_its_prefix_from_cache(llamacpp, demo_assets):
    url, adapters = llamacpp
    prompt = Prompts(demo_assets.lm_dir, seed=7).text(128)
    fill = {"prompt": prompt, "n_predict": 1, "id_slot": 0, **llamacpp_body(adapters, BASE)}
    httpx.post(f"{url}/completion", json=fill, timeout=120).raise_for_status()
    saved = peer_servers.save_slot(url, 0, "prefix.bin")
    assert saved["n_saved"] >= 128 and saved["n_written"] > 0
    # primed with the base model's scales first: llama-server drops a slot's KV for a request whose adapter
    # scales differ from the slot's last request's, and slot 1 last served an adapter (or nothing)
    httpx.post(f"{url}/completion", json={**fill, "prompt": "x", "id_slot": 1, **llamacpp_body(adapters, "sql")},
               timeout=120).raise_for_status()
    restored = peer_servers.restore_slot(url, 1, "prefix.bin", fields=llamacpp_body(adapters, BASE))
    assert restored["n_restored"] == saved["n_saved"]
    after = httpx.post(f"{url}/completion", json={**fill, "prompt": prompt + " and more", "id_slot": 1},
                       timeout=120).json()
    assert after["timings"]["cache_n"] >= 128
    for bad in ("../escape.bin", "a/b.bin", ""):
        with pytest.raises(ServerError, match="HTTP 400"):
            peer_servers.save_slot(url, 0, bad)
    with pytest.raises(ServerError, match="llama.cpp slot restore"):
        peer_servers.restore_slot(url, 1, "never-saved.bin")
