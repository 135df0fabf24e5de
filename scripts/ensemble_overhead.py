"""What the ensemble's first two steps cost: time to first token of ``ensemble`` against ``lora_adapter`` called
directly with the same token ids, measured with plain ``tritonclient`` (nothing of ``warmup_tools`` is imported).

    python -m warmup_tools serve --http-port 18000 --grpc-port 18001 &   # or any running server
    python scripts/ensemble_overhead.py localhost:18001 http://localhost:18000 200

Takes each prompt's token ids from ``tokenizer_cache`` (which warms its cache), runs every path once, then
alternates ensemble and lora_adapter requests (``max_tokens`` 1, adapter ``support``); prints both p50s, their
difference and, from Triton's statistics extension, what each of the two cache models spent per request.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

PROMPT = ("You are a support assistant for Acme. Be brief and kind. " * 12) + "User: where is my order {}?\nAssistant:"
CACHE_MODELS = ("tokenizer_cache", "embedding_cache")


def tensor(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    item = grpcclient.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array)
    return item


def common_inputs() -> list[grpcclient.InferInput]:
    return [tensor("max_tokens", np.array([1], dtype=np.int32), "INT32"),
            tensor("stream", np.array([True]), "BOOL"),
            tensor("adapter_id", np.array([b"support"], dtype=np.object_), "BYTES")]


def ensemble_inputs(text: str) -> list[grpcclient.InferInput]:
    return [tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"), *common_inputs()]


def lora_inputs(ids: list[int]) -> list[grpcclient.InferInput]:
    return [tensor("input_ids", np.array(ids, dtype=np.int32), "INT32"), *common_inputs()]


class Stream:
    """One gRPC stream; :meth:`first_token` sends a request and returns its time to first response in ms."""

    def __init__(self, url: str) -> None:
        self.responses: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.responses.put((time.perf_counter(), result,
                                                                                     error)))

    def first_token(self, model: str, inputs: list[grpcclient.InferInput]) -> float:
        start = time.perf_counter()
        self.client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        first = None
        while True:
            arrived, result, error = self.responses.get(timeout=60)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            first = first or arrived
            if result.get_response().parameters["triton_final_response"].bool_param:
                return (first - start) * 1e3

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def model_stats(http_url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats") as answer:
        return json.load(answer)["model_stats"][0]["inference_stats"]


def p(values: list[float], q: float) -> float:
    return sorted(values)[int(q / 100 * (len(values) - 1))]


def main(grpc_url: str, http_url: str, count: int) -> None:
    stream = Stream(grpc_url)
    texts = [PROMPT.format(i % 50) for i in range(count)]
    ids = {}
    for text in dict.fromkeys(texts):
        answer = stream.client.infer("tokenizer_cache",
                                     [tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES")])
        ids[text] = answer.as_numpy("input_ids").tolist()
        stream.first_token("ensemble", ensemble_inputs(text))
        stream.first_token("lora_adapter", lora_inputs(ids[text]))
    before = {m: model_stats(http_url, m) for m in CACHE_MODELS}
    ensemble, direct = [], []
    for index, text in enumerate(texts):
        order = ("ensemble", "lora_adapter") if index % 2 == 0 else ("lora_adapter", "ensemble")
        for model in order:
            if model == "ensemble":
                ensemble.append(stream.first_token(model, ensemble_inputs(text)))
            else:
                direct.append(stream.first_token(model, lora_inputs(ids[text])))
    after = {m: model_stats(http_url, m) for m in CACHE_MODELS}
    stream.close()
    e50, d50 = statistics.median(ensemble), statistics.median(direct)
    print(f"ensemble TTFT p50 {e50:.2f} ms (p90 {p(ensemble, 90):.2f}); lora_adapter p50 {d50:.2f} ms "
          f"(p90 {p(direct, 90):.2f}); difference p50 {e50 - d50:.2f} ms")
    for model in CACHE_MODELS:
        served = int(after[model]["success"]["count"]) - int(before[model]["success"]["count"])
        for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
            ns = int(after[model][phase]["ns"]) - int(before[model][phase]["ns"])
            print(f"  {model:16} {phase:15} {ns / max(served, 1) / 1e6:.3f} ms per request ({served} requests)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 200)
