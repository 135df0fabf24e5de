#!/usr/bin/env bash
# AIPerf (its own virtualenv, unchanged) against the OpenAI front and, beside it, the same load through Triton's
# generate extension: streamed chat completions and completions on the front, the `template` endpoint type on
# /v2/models/ensemble/generate_stream, at concurrency 1 and 8, alternated REPEATS times (the machine is shared).
# Usage: scripts/aiperf_front.sh FRONT_URL TRITON_HTTP_URL OUT_DIR   (a server started with
#        `python -m warmup_tools serve`; AIPERF, TOKENIZER, REPEATS, ISL, OSL from the environment)
set -euo pipefail
front=${1:?front URL}; triton=${2:?Triton HTTP URL}; out=${3:?output folder}
aiperf=${AIPERF:-aiperf}; tokenizer=${TOKENIZER:-.assets/lm}; here=$(cd "$(dirname "$0")" && pwd)
common=(--isl "${ISL:-64}" --isl-stddev 0 --osl "${OSL:-32}" --osl-stddev 0 --tokenizer "$tokenizer"
        --random-seed 0 --warmup-request-count 4 --no-auto-plot --streaming)
for rep in $(seq 1 "${REPEATS:-2}"); do
  for conc in 1 8; do
    count=$((conc == 1 ? 40 : 80))
    "$aiperf" profile "${common[@]}" --concurrency "$conc" --request-count "$count" \
      --artifact-dir "$out/front-chat-c$conc-r$rep" --model support --url "$front" --endpoint-type chat
    "$aiperf" profile "${common[@]}" --concurrency "$conc" --request-count "$count" \
      --artifact-dir "$out/generate-stream-c$conc-r$rep" --model ensemble --url "$triton" --endpoint-type template \
      --custom-endpoint /v2/models/ensemble/generate_stream \
      --extra-inputs "payload_template:$here/aiperf_generate_stream.jinja" --extra-inputs response_field:text_output
    "$aiperf" profile "${common[@]}" --concurrency "$conc" --request-count "$count" \
      --artifact-dir "$out/front-completions-c$conc-r$rep" --model support --url "$front" --endpoint-type completions
  done
done
