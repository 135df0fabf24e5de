"""bench peer's parts that need no server: vLLM's command line, the prompts, the table."""

from __future__ import annotations

import json

import pytest

from warmup_tools.sim.bench import peer
from warmup_tools.sim.bench.peer import Figures, Prompts, format_table
from warmup_tools.sim.bench.support.peer_servers import BASE, vllm_argv


def test_vllm_runs_the_same_model_with_prefix_caching_and_every_adapter_folder_at_its_rank(tmp_path):
    (tmp_path / "lm").mkdir()
    for name, rank in (("sql", 8), ("legal", 16)):
        (tmp_path / "adapters" / name).mkdir(parents=True)
        (tmp_path / "adapters" / name / "adapter_config.json").write_text(json.dumps({"r": rank}))
    (tmp_path / "adapters" / "notes").mkdir()  # not an adapter: no adapter_config.json
    python = tmp_path / "venv" / "bin" / "python"
    base = vllm_argv(python, tmp_path, lora=False, max_num_seqs=8, port=9)
    assert base[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert base[base.index("--model") + 1] == str(tmp_path / "lm")
    assert base[base.index("--served-model-name") + 1] == BASE
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(base)
    assert "--enable-lora" not in base and base[base.index("--max-num-seqs") + 1] == "8"
    assert base[base.index("--host") + 1] == "127.0.0.1"  # the loopback only
    lora = vllm_argv(python, tmp_path, lora=True, max_num_seqs=8, port=9)
    assert lora[lora.index("--max-lora-rank") + 1] == "16" and lora[lora.index("--max-loras") + 1] == "2"
    modules = lora[lora.index("--lora-modules") + 1:]
    assert modules == [f"legal={tmp_path / 'adapters' / 'legal'}", f"sql={tmp_path / 'adapters' / 'sql'}"]
    assert "--block-size" not in base  # vLLM's own default unless asked
    small = vllm_argv(python, tmp_path, lora=False, max_num_seqs=8, port=9, block_size=32)
    assert small[small.index("--block-size") + 1] == "32"


def test_prompts_have_at_least_the_tokens_asked_and_no_two_share_their_first_words(demo_assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_assets.root / "lm")
    prompts = Prompts(demo_assets.root / "lm", seed=0)
    texts = [prompts.text(n) for n in (16, 64, 512, 16)]
    for text, n in zip(texts, (16, 64, 512, 16)):
        assert n <= len(tokenizer.encode(text, add_special_tokens=False)) <= n + 8
    assert len({t.split(":")[0] for t in texts}) == 4  # "Note 1:", "Note 2:", ...
    again = Prompts(demo_assets.root / "lm", seed=0)
    assert [again.text(n) for n in (16, 64, 512, 16)] == texts  # seeded: both servers get the same text


def test_the_table_gives_each_figure_of_both_servers_and_their_ratio():
    project = Figures(300.0, 50.0, 40.0, 60.0, 200.0, 500.0, 512)
    vllm = Figures(200.0, 25.0, 40.0, 90.0, 400.0, 250.0, 512)
    table = format_table({BASE: {"project": project, "vllm": vllm}, "sql": {"project": vllm, "vllm": project}},
                         streams=8, threads=1, versions={"vllm": "0.32.0"})
    lines = table.strip().splitlines()
    assert "vLLM 0.32.0, 1 LM thread(s) each" in lines[0]
    assert lines[1] == "| | base model: project / vLLM (ratio) | sql: project / vLLM (ratio) |"
    assert "| TTFT, new 512-token prefix + 16 (cold), ms | 300 / 200 (1.50) | 200 / 300 (0.67) |" in lines
    assert "| output tokens/s, 8 streams | 200 / 400 (0.50) | 400 / 200 (2.00) |" in lines
    assert lines[-1] == "| cached prompt tokens of the warm request | 512 / 512 | 512 / 512 |"


def test_the_ab_table_compares_the_project_with_its_other_forward():
    packed = Figures(150.0, 30.0, 25.0, 120.0, 600.0, 200.0, 512)
    hf = Figures(300.0, 50.0, 40.0, 60.0, 300.0, 500.0, 512)
    table = format_table({BASE: {"project": packed, "project-hf": hf}}, streams=8, threads=1,
                         versions={"vllm": "0.32.0"}, ours="project", theirs=("project-hf",))
    lines = table.strip().splitlines()
    assert "project / project-hf, 1 LM thread(s) each" in lines[0]
    assert lines[1] == "| | base model: project / project-hf (ratio) |"
    assert "| output tokens/s, 8 streams | 600 / 300 (2.00) |" in lines


def test_the_replay_table_gives_both_servers_cold_share_cached_share_and_ttft():
    from warmup_tools.sim.bench.support.peer_replay import format_replay
    from warmup_tools.sim.bench.support.workload import Served, figures

    project = figures("project", [Served(0, False, 10.0, 96, 100), Served(1, True, 30.0, 0, 50),
                                  Served(2, False, 20.0, 64, 80), Served(3, True, 40.0, 0, 10)])
    vllm = figures("vllm", [Served(0, False, 5.0, 100, 100)])
    table = format_replay({"project": project, "vllm": vllm}, traffic="real", block_size=32)
    assert "vLLM with --block-size 32" in table
    assert "| cold share (no prompt token from cache) | 50.0% | 0.0% |" in table
    assert "| prompt tokens from cache | 66.7% | 100.0% |" in table
    assert "| TTFT p50 / p90, ms | 25 / 30 | 5 / 5 |" in table


class _Clock:
    """A fake monotonic clock that sleeping advances (no real waiting)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _settle_with(monkeypatch, samples):
    clock, reads = _Clock(), iter(samples)
    monkeypatch.setattr(peer.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(peer.time, "sleep", clock.sleep)
    monkeypatch.setattr(peer, "_cpu_times", lambda: next(reads))
    return peer.settle()


def test_settle_waits_while_the_cores_are_busy_and_returns_after_a_quiet_window(monkeypatch):
    # (total, idle) jiffies: two busy windows (a spinning peer), then a quiet one
    busy_then_quiet = [(0, 0), (100, 0), (200, 10), (300, 105)]
    assert _settle_with(monkeypatch, busy_then_quiet) == pytest.approx(3 * peer.SETTLE_WINDOW_S)


def test_settle_gives_up_on_cores_busy_with_something_else_and_waits_one_window_without_proc_stat(monkeypatch):
    always_busy = [(i * 100, 0) for i in range(1000)]
    waited = _settle_with(monkeypatch, always_busy)
    assert peer.SETTLE_MAX_S < waited <= peer.SETTLE_MAX_S + 2 * peer.SETTLE_WINDOW_S
    assert _settle_with(monkeypatch, [None, None]) == pytest.approx(peer.SETTLE_WINDOW_S)
