"""Chat traffic through the OpenAI front is planned like raw prompts: the request log holds the rendered
conversation (and its role spans), and a plan made from it warms the system prompts of chat requests, so
their first request after a restart starts from the KV cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import openai
import pytest

from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2] / "model_repository"
TENANT = "chat-app"
SYSTEM = ("You are the travel desk assistant of Northwind Travel. You book flights, trains and hotels for "
          "employees, always within the travel policy: economy class for flights under six hours, standard rooms "
          "under two hundred euros a night, trains preferred for trips under four hours. Ask for the traveller's "
          "employee number, cost centre and dates before proposing anything, offer at most three options, and "
          "state the total price with taxes for each. Never book without an explicit confirmation.")
QUESTIONS = ["I need to be in Berlin on Monday morning.", "Book me a hotel in Lyon for two nights.",
             "Is a train to Amsterdam allowed?", "Change my flight to Thursday.", "What is the hotel limit in Oslo?",
             "I need a return trip to Milan next week.", "Can I fly business to New York?",
             "Find me a train from Paris to Brussels."]


def _front(server, assets):
    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings

    settings = FrontSettings(port=0, triton_grpc_url=server.grpc_url, triton_metrics_url=server.metrics_url,
                             model_repository=server.model_repository, poll_interval_s=0.2)
    return FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(assets)})


def _ask(front, question):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="open", max_retries=0,
                       default_headers={"X-Tenant-Id": TENANT}) as client:
        return client.chat.completions.create(model="sql", max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_a_plan_from_chat_logs_warms_the_system_prompt_of_chat_requests(triton, demo_assets, served_assets,
                                                                        tmp_path):
    from warmup_tools.common.jsonl import ReadStats
    from warmup_tools.common.records import log_files, read_request_log
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.plan_stanzas import write_plan_stanzas
    from warmup_tools.planning.select import build_plan
    from warmup_tools.planning.target import PlanTarget
    from warmup_tools.server.process import TritonServer

    with _front(triton, triton.assets_dir) as front:
        for question in QUESTIONS[:-1]:
            _ask(front, question)

    def chat_records():
        found = [r for r in read_request_log(log_files(triton.request_log_dir), ReadStats()) if r.tenant == TENANT]
        return found if len(found) >= len(QUESTIONS) - 1 else None

    records = wait_for(chat_records, "the chat requests in the request log")
    first = records[0]
    assert first.prompt.startswith(SYSTEM + "\n\nUser: ") and first.prompt.endswith("\nAssistant:")
    assert first.roles[0] == ("system", 0, len(SYSTEM) + 2) and first.roles[1][0] == "user"

    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo)
    target = PlanTarget.from_repository(repo, {**os.environ, "WARMUP_ASSETS_DIR": str(demo_assets.root)})
    plan = build_plan(records, target.load_tokenizer(), OnnxEmbedder(target.embedder), target.default_budgets(),
                      now=max(r.ts for r in records), block_size=target.block_size,
                      kv_bytes_per_token=target.kv_bytes_per_token, progress=False)
    assert any(item["tenant"] == TENANT for item in plan.items)
    write_plan_stanzas(plan, repo, target=target)

    server = TritonServer(repo, env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": ""},
                          work_dir=tmp_path / "work")
    with server:
        server.wait_ready(timeout=900)
        with _front(server, served_assets) as front:
            answer = _ask(front, QUESTIONS[-1])  # a question nobody asked before, after the restart
    assert answer.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM) // 8, answer.usage
