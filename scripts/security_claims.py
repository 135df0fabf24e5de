"""The security claims and the tests that check them: one list, from which docs/security-claims.md is written.

Each claim is one statement SECURITY.md makes in short, written out in full, with the test node ids that
check it (``path::function``, or a whole test file). ``tests/unit/test_security_claims.py`` checks that every
test named exists and that docs/security-claims.md is this script's output.

    .venv/bin/python scripts/security_claims.py > docs/security-claims.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    text: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Area:
    title: str
    #: the section of SECURITY.md that states these claims in short
    section: str
    claims: tuple[Claim, ...]


_CONTROL = "tests/unit/common/test_control_json.py"
_TRUST = "tests/unit/triton/test_trust.py"
_TRUST_IT = "tests/integration/test_trust.py"
_REQUESTS = "tests/unit/lora_adapter/test_requests.py"
_FAULTS_IT = "tests/integration/test_engine_faults.py"
_SCHED = "tests/unit/lora_adapter/test_scheduler_faults.py"
_KV_SNAP = "tests/unit/kv/test_snapshot.py"
_LORA_SNAP = "tests/unit/lora_adapter/test_snapshots.py"
_REDIS = "tests/unit/caches/test_redis_tier.py"
_DEPLOY = "tests/unit/test_deploy.py"
_HEALTH = "tests/unit/sidecar/test_health.py"
_FRONT_HTTP = "tests/unit/front/test_http.py"
_TRACING = "tests/unit/common/test_tracing.py"
_KV_EVENTS = "tests/unit/smg_worker/test_event_server.py"
_GRPC = "tests/unit/front/smg_grpc"
_GRPC_IT = "tests/integration/test_smg_grpc_worker.py"
_CONTROL_KEY = "tests/unit/fleet/test_control_key.py"

AREAS: tuple[Area, ...] = (
    Area("Operators' files: the control folder", "threat-model", (
        Claim("An instance reads at most 16 MiB and 4,096 items of `plan.json` and checks its format, content hash, "
              "tenant and adapter names and token ids; an item outside the vocabulary or the context is left out, "
              "never warmed, and counted in the instance's plan status.",
              ("tests/unit/lora_adapter/test_live_plan.py::"
               "test_plan_items_outside_the_vocabulary_or_the_context_are_left_out_and_counted",)),
        Claim("A bad or oversized control file is refused with one log line and the instance keeps its plan.",
              ("tests/unit/control/test_plan_control.py::"
               "test_bad_and_oversized_files_are_refused_once_and_the_instance_keeps_its_plan",)),
        Claim("`desired.json` holding more than 65,536 JSON values is refused before it is parsed (counted on its "
              "bytes in one pass), with one log line, and the instance keeps its adapters; a FIFO, socket or "
              "directory in place of a control file (`desired.json`, `plan.json`, `canary.json`, a status file) is "
              "refused at once, never blocking a reader.",
              ("tests/unit/control/test_registry.py::"
               "test_a_desired_file_of_millions_of_empty_lists_is_refused_before_parsing_and_the_instance_keeps_its_adapters",
               f"{_CONTROL}::test_a_document_of_more_values_than_its_reader_allows_is_refused_before_it_is_parsed",
               "tests/unit/control/test_registry.py::"
               "test_a_desired_file_that_is_a_fifo_is_refused_once_and_never_blocks_a_reader",
               "tests/unit/control/test_plan_control.py::"
               "test_a_fifo_in_place_of_plan_json_canary_json_or_a_status_file_is_refused_without_blocking",
               "tests/unit/common/test_regular_file.py::test_a_fifo_socket_or_directory_is_refused_at_once")),
        Claim("`plan.json` holding more than 65,536 JSON arrays and objects (262,144 for the sidecar's plan loader) is "
              "refused before it is parsed, counted on its bytes in one linear pass, with one log line, and the "
              "instance keeps the plan it serves; a real plan at the 4,096-item cap is well within the bound.",
              ("tests/unit/control/test_plan_control.py::"
               "test_a_plan_of_more_arrays_and_objects_than_allowed_is_refused_before_parsing_and_the_instance_keeps_its_plan",
               f"{_CONTROL}::test_a_document_of_more_containers_than_its_reader_allows_is_refused_before_it_is_parsed",
               f"{_CONTROL}::test_the_containers_counted_on_the_bytes_are_those_parsed_and_ignore_strings",
               "tests/unit/control/test_plan_control.py::"
               "test_a_plan_at_the_item_cap_with_everything_a_planner_writes_per_item_is_within_the_containers_bound")),
        Claim("Every JSON file of the control folder (`desired.json` at most 16 MiB, `plan.json`, the status files; "
              "the sidecar reads at most 256 KiB per plan status file) is read up to its size cap and parsed by "
              "`json.loads` in time linear in its size: no pattern scans the raw bytes, so one unclosed quote is one "
              "more bad file.",
              (f"{_CONTROL}::test_an_unterminated_string_is_refused_without_hanging_the_reader", _CONTROL)),
        Claim("A file nested deeper than the parser's recursion limit is a bad file, never a `RecursionError`, and a "
              "parsed one nested more than 32 deep is refused, each with an error naming the file and the cause; the "
              "instance keeps polling and starts and converges once the files are fixed.",
              (_CONTROL,
               "tests/unit/control/test_registry.py::"
               "test_a_deeply_nested_control_file_is_a_bad_file_and_the_instance_keeps_polling",
               "tests/unit/lora_adapter/test_service.py::"
               "test_an_instance_starts_and_converges_when_the_control_files_are_nested_100000_deep")),
    )),
    Area("The models' own warm-up samples", "threat-model", (
        Claim("A model's warm-up samples may use the control input `warmup_plan` and name their tenant without a key "
              "only while the model loads: each instance follows the run Triton makes of its samples before READY "
              "(each sample in config order, `max(count, 1)` times, `batch_size` requests each, `batch_size` 0 "
              "skipped); a request counts as a sample only if it is byte for byte the next one, and the first "
              "request that is not, or the end of the run, closes that for good (`warmup_tools/triton/warmup.py`).",
              ("tests/unit/triton/test_warmup.py::test_a_sample_is_honoured_exactly_as_often_as_triton_runs_it_at_load",
               "tests/unit/triton/test_warmup.py::test_the_first_request_that_is_not_the_next_sample_closes_the_window")),
        Claim("After load a byte-identical replay of a sample is an ordinary client request: `warmup_plan` in it gets "
              "`INVALID_ARG`, and in trust mode its tenant needs a key.",
              (f"{_TRUST_IT}::test_a_warm_up_sample_replayed_after_ready_is_an_ordinary_request",)),
        Claim("`warmup_retention_s` (how long a sample's KV stays pinned) is a control input like `warmup_plan`: a "
              "client request carrying it, alone or with `warmup_plan`, is refused and the server keeps serving.",
              ("tests/unit/triton/test_warmup.py::test_a_client_request_with_warmup_retention_s_is_refused",
               "tests/unit/triton/test_warmup.py::test_after_load_a_request_with_only_a_retention_is_refused_naming_it",
               "tests/integration/test_errors.py::test_a_client_cannot_set_how_long_kv_stays_pinned_through_lora_adapter")),
        Claim("A retention is finite seconds in (0, 30 days], one number, and only beside a `warmup_plan` that pins, "
              "wherever it enters (a sample's input, a plan item in plan.json or `Plan.load`, stanzas before they "
              "are written); a bad one is refused naming the bound, never echoing the value.",
              (f"{_REQUESTS}::test_a_retention_that_is_not_finite_positive_seconds_up_to_30_days_is_refused",
               f"{_REQUESTS}::test_a_retention_of_the_wrong_shape_or_type_is_refused",
               f"{_REQUESTS}::test_a_retention_without_a_plan_that_pins_is_refused",
               "tests/unit/control/test_plan_control.py::test_an_item_whose_retention_is_not_seconds_in_its_bound_is_refused",
               "tests/unit/control/test_plan_control.py::test_a_retention_of_nan_or_infinity_is_refused",
               "tests/unit/planning/test_plan_stanzas.py::"
               "test_an_item_whose_retention_lora_adapter_would_refuse_is_refused_before_anything_is_written",
               "tests/unit/planning/test_replay_sizing.py::test_plan_load_refuses_an_item_retention_the_server_would_refuse")),
        Claim("A pin is bounded in time and in bytes: it ends at its deadline, warm-up holds at most `kv_warm_share` "
              "of the budget, and pins that cost live traffic more hits than they give over a window are released "
              "(the live check); a plan whose replay shows no gain pins nothing.",
              ("tests/unit/kv/test_pin_retention.py::test_a_pin_holds_until_its_deadline_then_is_an_ordinary_block",
               "tests/unit/kv/test_pin_retention.py::test_warm_share_caps_what_warm_up_may_hold",
               "tests/unit/kv/test_pin_retention.py::test_the_live_check_releases_pins_that_cost_more_than_they_give",
               "tests/integration/test_pin_check.py",
               "tests/unit/planning/test_replay_sizing.py::"
               "test_a_plan_whose_hot_prefixes_never_recur_in_the_tail_warms_nothing_and_says_why")),
        Claim("The live check's section of a plan status is checked when read (known states, bounded counts, at most "
              "256 adapters with valid names, printable reason up to 500 characters); the sidecar's public `/status` "
              "and `/metrics` show it without the plan id.",
              ("tests/unit/control/test_plan_control.py::test_a_status_with_a_malformed_pin_report_is_not_read",
               "tests/unit/control/test_plan_control.py::test_a_pin_reports_reason_is_printable_text_of_bounded_length",
               "tests/unit/sidecar/test_coverage.py::"
               "test_status_and_metrics_show_each_instances_live_check_per_plan_and_adapter_without_its_plan_id")),
    )),
    Area("Tenant isolation in the caches", "tenant-isolation-the-two-modes", (
        Claim("The tokenizer and embedding caches key by tenant, in the local tier and in Redis: another tenant's "
              "identical prompt is a miss.",
              ("tests/unit/embedding_cache/test_service.py::test_the_embedding_cache_is_keyed_by_tenant_in_both_tiers",)),
        Claim("Every KV block remembers its tenant; a match for another tenant is refused and counted "
              "(`warmup_kv_cross_tenant_hits_total`), and the integration tests' server asserts the count stayed 0 "
              "over the whole suite.",
              ("tests/conftest.py::triton",)),
        Claim("Semantic clusters are per tenant: a prompt joins only clusters its own tenant's prompts formed, and "
              "`embedding_cache` outputs a keyed `cluster_id` per tenant, so a direct caller's `cluster_id` and "
              "`similarity` are the same whether another tenant sent a similar prompt or not.",
              ("tests/unit/embedding_cache/test_semantic.py::"
               "test_tenant_b_s_prompt_similar_to_tenant_a_s_gets_no_signal_of_a",
               "tests/unit/embedding_cache/test_service.py::"
               "test_a_direct_caller_gets_no_signal_of_another_tenant_s_similar_prompt")),
        Claim("Tenants share only the cluster table's capacity (`max_clusters`); once it is full a tenant below its "
              "fair share gets a slot from one above it.",
              ("tests/unit/embedding_cache/test_semantic.py::"
               "test_a_full_cluster_table_gives_a_tenant_below_its_share_a_slot_of_one_above_it",)),
        Claim("Public prefixes (`public_prefixes_file`) are hashed in a public scope; every block after one is in the "
              "tenant's own scope, chained from the public one: another tenant reuses exactly the prefix's blocks "
              "and none of the first tenant's own text.",
              ("tests/unit/lora_adapter/test_engine.py",)),
    )),
    Area("Trust mode: tenant keys and tokens", "trust-mode", (
        Claim("Each model re-reads the tenant keys file when its inode, size or mtime change, at most 1 MiB, parsed "
              "once per change.",
              (f"{_TRUST}::test_the_keys_file_is_parsed_once_per_change_and_bounded",)),
        Claim("A forged, expired, wrong-audience or stale tenant token gets the same `INVALID_ARG` error, the MAC and "
              "key version compared in constant time; a token expires after `tenant_token_ttl_s` and is only for "
              "the models it names.",
              (f"{_TRUST}::test_a_token_with_any_field_changed_is_refused_with_the_same_error",
               f"{_TRUST}::test_a_token_expires_after_its_ttl",
               f"{_TRUST}::test_a_token_is_only_for_the_models_it_names")),
        Claim("Rotating a tenant's key or removing the tenant ends every token made before, without a restart, and "
              "the new key works at once; against a real server, a token taken from `tokenizer_cache` stops "
              "working at `embedding_cache` and `lora_adapter`.",
              (f"{_TRUST}::test_rotating_a_key_or_removing_a_tenant_ends_its_tokens_without_a_restart",
               f"{_TRUST_IT}::test_a_token_stops_working_once_its_tenant_s_key_is_rotated")),
        Claim("Each keys-file entry is exactly `sha256:<64 hex digits>`; any other is refused with a message naming "
              "the tenant.",
              ("tests/unit/triton/test_trust_contract.py::"
               "test_read_key_hashes_refuses_a_malformed_entry_with_a_message_naming_the_tenant",)),
        Claim("No `tenant_key` (absent or empty) proves a tenant, even one whose stored hash is the empty key's.",
              ("tests/unit/triton/test_trust_contract.py::"
               "test_a_missing_or_empty_key_proves_no_tenant_even_against_the_empty_key_s_hash",)),
        Claim("Against a real tritonserver, tenant B with its own key probing 50 of tenant A's prompts gets "
              "`cached_tokens == 0` on every probe, like 50 never-seen prompts.",
              (f"{_TRUST_IT}::test_another_tenant_learns_nothing_from_the_kv_cache",)),
        Claim("Claiming a tenant without its key, with another tenant's key, or calling a later step with a forged "
              "or missing token is refused.",
              (f"{_TRUST_IT}::test_a_tenant_cannot_be_claimed_without_its_key", _TRUST)),
        Claim("In open mode a client cannot name the sidecar's probe tenant: the sidecar proves it with a per-start "
              "random probe secret it hands to the tritonserver it starts, and a client sending "
              "`tenant_id=warmup-sidecar-probe` gets `INVALID_ARG` at every model.",
              (f"{_TRUST}::test_in_open_mode_a_client_cannot_name_the_probe_tenant",
               f"{_HEALTH}::test_in_open_mode_probes_prove_the_probe_tenant_with_the_per_start_secret",
               "tests/integration/test_sidecar.py::test_a_killed_lora_adapter_stub_is_reloaded_and_serves_warm_again")),
        Claim("In trust mode the sidecar's probes carry the probe tenant's key and a fresh token signed for the "
              "later steps before every probe.",
              (f"{_HEALTH}::test_in_trust_mode_probes_carry_the_probe_tenant_s_key_and_a_fresh_signed_token",)),
    )),
    Area("Inputs a client controls", "bounds-on-inputs", (
        Claim("Text is at most 256 KiB, checked before it is decoded, in every model, `lora_adapter`'s optional "
              "`text_input` included (one source, `MAX_TEXT_BYTES`); through the server a 2 MiB `text_input` sent "
              "straight to `lora_adapter` is refused with that message.",
              (f"{_REQUESTS}::test_text_input_is_bounded_before_it_is_decoded_like_every_models_prompt_text",
               f"{_FAULTS_IT}::test_a_2_mib_text_input_straight_to_lora_adapter_is_refused")),
        Claim("`temperature` is 0 or 0.01 to 100 (`MIN_TEMPERATURE`: a float32 division survives it with a margin of "
              "10^36); through the server, 16 concurrent requests with temperature 1e-40 are each refused "
              "(INVALID_ARG, HTTP 400 through `ensemble`) and an ordinary request is served after them, through "
              "`ensemble` and straight to `lora_adapter`.",
              (f"{_REQUESTS}::test_temperature_must_be_0_or_at_least_the_minimum_a_float32_division_survives",
               f"{_FAULTS_IT}::"
               "test_concurrent_denormal_temperatures_through_the_ensemble_get_invalid_arg_then_a_request_is_served",
               f"{_FAULTS_IT}::"
               "test_concurrent_denormal_temperatures_straight_to_lora_adapter_are_refused_then_a_request_is_served")),
        Claim("A lone surrogate in any text field of an OpenAI request (prompt, messages and their parts, name, "
              "stop, model, user, suffix) gets 400 `invalid_request_error` naming the field, never a 500; sent "
              "straight to Triton it never reaches a model as text and Triton serves on.",
              ("tests/unit/front/test_schemas.py::test_a_lone_surrogate_is_a_400_naming_the_field_and_not_echoing_it",
               "tests/unit/front/test_schemas.py::"
               "test_every_text_field_of_a_request_is_checked_by_the_one_unicode_check",
               "tests/integration/test_front.py::test_bad_requests_get_clear_errors_and_the_front_serves_after_them",
               "tests/integration/test_errors.py::"
               "test_a_lone_surrogate_through_triton_s_http_generate_is_refused_by_its_parser_and_triton_serves_on",
               "tests/unit/triton/test_inputs.py::test_a_lone_surrogate_or_other_invalid_utf8_is_refused_as_bytes_or_str")),
        Claim("A `top_p` below float32's smallest value still keeps the best token.",
              ("tests/unit/lora_adapter/test_sampling.py::"
               "test_a_top_p_below_float32s_smallest_value_still_keeps_the_best_token",)),
        Claim("A malformed, repeated or oversized W3C `traceparent` (HTTP header, gRPC metadata or Triton request "
              "parameter) is ignored before it is parsed and the request is served; a bad or oversized `tracestate` "
              "is dropped and the parent kept, and the client's text never reaches the log.",
              (f"{_TRACING}::test_a_malformed_traceparent_is_ignored",
               f"{_TRACING}::test_an_oversized_traceparent_is_ignored_before_parsing",
               f"{_TRACING}::test_headers_without_or_with_two_traceparents_give_no_context",
               f"{_TRACING}::test_context_from_grpc_metadata",
               f"{_TRACING}::test_triton_parameters_that_carry_no_valid_context",
               f"{_TRACING}::test_a_bad_or_oversized_tracestate_is_dropped_and_the_parent_kept",
               f"{_TRACING}::test_headers_whose_tracestates_are_too_long_together_keep_the_parent",
               "tests/integration/test_tracing.py::test_a_malformed_or_oversized_traceparent_is_ignored_and_the_request_served")),
        Claim("Tracing is off by default (no SDK imported, no exporter or thread started); a model never starts a "
              "trace of its own, an unsampled context exports nothing, and a failed span carries the error's kind, "
              "never its message.",
              (f"{_TRACING}::test_tracing_is_off_by_default",
               f"{_TRACING}::test_off_imports_no_sdk_and_starts_no_exporter",
               f"{_TRACING}::test_a_model_never_starts_a_trace_of_its_own",
               f"{_TRACING}::test_an_unsampled_context_records_nothing",
               "tests/integration/test_tracing.py::test_an_unsampled_context_exports_nothing",
               f"{_TRACING}::test_a_failed_span_carries_the_error_kind_not_its_text",
               "tests/unit/lora_adapter/test_traced.py::test_a_refused_request_ends_its_span_with_the_error_kind")),
    )),
    Area("One tenant's burst", "bounds-on-inputs", (
        Claim("`lora_adapter` admits per tenant: a tenant over its share of the queue is refused `rate_limited` "
              "while another tenant is still queued, and a tenant behind a flood gets a slot at the next step; a "
              "flood of unique tenants stays within the instance's bound and leaves no per-tenant entry behind.",
              ("tests/unit/lora_adapter/test_admission.py::"
               "test_a_flooding_tenant_is_refused_at_its_share_while_another_tenant_is_still_queued",
               "tests/unit/lora_adapter/test_admission.py::"
               "test_a_tenant_behind_a_flood_gets_a_slot_at_the_next_step_and_ends_long_before_the_flood",
               "tests/unit/lora_adapter/test_admission.py::"
               "test_a_flood_of_unique_tenants_is_bounded_and_leaves_no_entry_behind")),
        Claim("The sidecar's probe is admitted with every slot and the whole queue taken, and no tenant can use the "
              "probe slot.",
              ("tests/unit/lora_adapter/test_admission.py::"
               "test_the_probe_is_admitted_with_every_slot_and_the_whole_queue_taken_and_answers_in_its_first_step",
               "tests/unit/lora_adapter/test_admission.py::"
               "test_probes_are_bounded_and_a_tenant_cannot_use_the_probe_slot")),
        Claim("A busy answer to a probe means alive, and a model still generating tokens is never reloaded for its "
              "probes.",
              ("tests/unit/sidecar/test_saturation.py",)),
        Claim("The front answers a tenant over its share with 429 `rate_limit_exceeded` and `Retry-After`, and "
              "serves the next request.",
              ("tests/unit/front/test_rate_limit.py::"
               "test_the_client_gets_429_with_retry_after_and_the_front_serves_the_next_request",)),
        Claim("The OpenAI front bounds a tenant's requests in flight (`tenant_max_in_flight`, by default what "
              "`lora_adapter` admits of one tenant): one more gets 429 `rate_limit_exceeded` with `Retry-After` "
              "before any call to tritonserver while another tenant is served; the place is given back after a "
              "success, a refusal, an error, a client leaving mid-stream and a stream failing before its first "
              "byte; a flood of unique tenants leaves no entry; the sidecar's proven probe tenant is never refused.",
              ("tests/unit/front/test_admission.py::"
               "test_a_tenant_over_its_bound_gets_429_with_retry_after_before_the_engine_while_another_is_served",
               "tests/unit/front/test_admission.py::"
               "test_the_place_is_given_back_after_a_success_a_refusal_and_an_error_mid_stream",
               "tests/unit/front/test_admission.py::test_a_client_leaving_mid_stream_gives_its_place_back",
               "tests/unit/front/test_admission.py::test_a_stream_that_fails_before_its_first_byte_gives_its_place_back",
               "tests/unit/front/test_admission.py::test_a_flood_of_unique_tenants_leaves_no_entry",
               "tests/unit/front/test_admission.py::"
               "test_the_probe_tenant_proven_by_its_key_is_never_refused_and_other_tenants_are",
               "tests/unit/front/test_admission.py::test_the_default_bound_is_what_lora_adapter_holds_for_one_tenant")),
        Claim("One tenant flooding two replicas through a real smg gets 429s while another tenant is served "
              "throughout, and no replica goes not ready or reloads.",
              ("tests/integration/test_fleet_flood.py::"
               "test_one_tenant_flooding_two_replicas_gets_429_while_another_is_served_and_nothing_reloads",)),
    )),
    Area("One sequence's failure ends only that sequence", "bounds-on-inputs", (
        Claim("Whatever raises while the scheduler admits, stores, samples or sends one sequence ends it with one "
              "final error (INVALID_ARG where the request caused it, INTERNAL without the exception text for a "
              "fault of the server), frees its batch slot and KV memory, and the other sequences go on.",
              (f"{_SCHED}::test_a_denormal_temperature_ends_only_its_sequences_with_invalid_arg_and_frees_their_slots",
               f"{_SCHED}::test_an_exception_while_sampling_one_sequence_ends_it_with_internal_and_the_batch_goes_on")),
        Claim("A batched forward that fails is run again row by row, so only the rows that fail alone end.",
              (f"{_SCHED}::test_a_failed_batched_forward_is_retried_row_by_row_so_only_the_failing_row_ends",
               f"{_SCHED}::test_a_forward_that_always_fails_ends_every_sequence_with_one_error")),
        Claim("A step that fails outside any one sequence ends the sequences it held and the instance serves on.",
              (f"{_SCHED}::test_a_step_that_raises_outside_any_sequence_ends_what_it_held_and_the_thread_serves_on",)),
        Claim("A step that changes nothing makes the scheduler thread wait on its condition instead of spinning.",
              (f"{_SCHED}::test_a_step_that_changes_nothing_is_idle_and_the_thread_blocks_instead_of_spinning",)),
        Claim("A live request never waits for a warm-up prompt computing the same prefix.",
              (f"{_SCHED}::test_a_live_request_does_not_wait_for_a_warm_prompt_computing_its_prefix",)),
        Claim("A hypothesis fuzz of sampling and request parameters (denormal, infinite, NaN and huge temperatures "
              "and `top_p`, `top_k`, seeds, `max_tokens`, empty, oversize and out-of-vocabulary prompts, "
              "cancellations, tiny KV budgets): every request gets exactly one final response and no slot, KV byte "
              "or cache block is held afterwards.",
              (f"{_SCHED}::test_fuzz_every_request_gets_exactly_one_final_response_and_nothing_is_held_after",)),
    )),
    Area("Bounded memory", "bounds-on-inputs", (
        Claim("A pin is bound to its plan: a warm-up store for a plan other than the current one caches its blocks "
              "unpinned, is counted (`stale_plan_blocks`), and never moves the cache back to that plan or unpins "
              "the current plan's blocks; plan coverage counts blocks pinned under the plan.",
              ("tests/unit/kv/test_plan_pins.py::"
               "test_a_store_for_an_older_plan_after_a_plan_change_keeps_the_current_plan_s_pins",
               "tests/unit/lora_adapter/test_live_plan.py::"
               "test_a_sample_in_flight_during_a_live_plan_change_leaves_the_new_plan_pinned_and_covered")),
        Claim("KV events are bounded: a journal keeps `kv_events_window_blocks` blocks of events (a flood of unique "
              "prompts moves the window, never grows it), and a subscriber whose number fell out of it gets "
              "OUT_OF_RANGE (resubscribe for the state) instead of a partial history.",
              ("tests/unit/kv/test_events.py::"
               "test_a_number_outside_the_window_asks_for_a_resync_and_the_window_stays_bounded",
               f"{_KV_EVENTS}::test_a_number_outside_the_window_is_out_of_range_before_headers")),
        Claim("An instance's KV events are served on a unix socket in a per-start 0700 folder, never on a network "
              "port; a subscriber's malformed scope (adapter or tenant name) is refused with INVALID_ARGUMENT and the "
              "server keeps serving; a socket path too long for the kernel is refused at start.",
              (f"{_KV_EVENTS}::test_a_malformed_scope_is_refused_and_the_server_keeps_serving",
               f"{_KV_EVENTS}::test_the_socket_path_is_bounded",
               "tests/integration/test_kv_events.py::test_a_new_subscriber_sees_the_warm_up_samples_blocks")),
        Claim("The engine's `reuse_freed_mib` (freed host memory kept for reuse, 256 MiB by default) is bounded "
              "(0 to 1,048,576 MiB); a value out of bounds is refused at load with an error naming the parameter.",
              ("tests/unit/lora_adapter/test_devices.py::test_reuse_freed_mib_is_a_bounded_setting_of_the_engine",)),
        Claim("The soak benchmark's judgements (flat RSS, open files and threads after the first 5 minutes, no "
              "request lost outside the recovery windows, every bad request with its error class) are "
              "unit-tested; the figures are in docs/soak.md.",
              ("tests/unit/sim/test_soak.py",)),
    )),
    Area("Files and KV snapshots", "secrets-and-their-files", (
        Claim("A FIFO, symbolic link or directory in place of a snapshot manifest or payload is refused without "
              "blocking, in both modes; in trust mode the manifest's MAC is checked over its raw bytes before "
              "anything is parsed, and a manifest larger than its payload bound can need is refused before parsing.",
              ("tests/unit/kv/test_snapshot_verify.py::"
               "test_a_fifo_or_a_symbolic_link_in_place_of_a_snapshot_file_is_refused_without_blocking",
               "tests/unit/lora_adapter/test_snapshots.py::"
               "test_a_restore_skips_a_snapshot_whose_payload_is_a_fifo_and_does_not_block",
               "tests/unit/kv/test_snapshot_verify.py::"
               "test_a_trust_mode_reader_checks_the_mac_over_the_raw_bytes_before_it_parses_anything",
               "tests/unit/kv/test_snapshot_verify.py::"
               "test_the_manifest_bound_follows_the_payload_bound_and_is_checked_before_parsing")),
        Claim("Every file written atomically (plans, stanza data files, `desired.json`, the status files, the "
              "semantic index) is 0600 whatever the umask, also when it replaces a world-readable file; only a "
              "model's `config.pbtxt` keeps the bits it had.",
              ("tests/unit/common/test_files.py",)),
        Claim("A snapshot's sizes are bounded, its payload is safetensors (never pickle), and the manifest's and the "
              "payload's SHA-256 must match.",
              (f"{_KV_SNAP}::test_truncated_payload_flipped_byte_and_missing_payload_are_refused",
               f"{_KV_SNAP}::test_bad_json_flipped_manifest_byte_and_foreign_versions_are_refused")),
        Claim("A key the snapshot format does not name, anywhere in the manifest, refuses the snapshot "
              "(`unknown_key`).",
              (f"{_KV_SNAP}::test_a_manifest_key_the_format_does_not_name_is_refused_not_ignored",)),
        Claim("Every value of every block is finite, checked over the whole payload: a NaN or infinite value "
              "refuses the snapshot (`not_finite`) whichever blocks the recompute draws.",
              (f"{_KV_SNAP}::test_a_block_holding_nan_or_infinite_kv_is_refused_with_its_digests_consistent",
               f"{_KV_SNAP}::test_int8_scales_that_are_not_finite_are_refused",
               f"{_LORA_SNAP}::test_a_nan_block_is_never_restored_whichever_blocks_the_sample_checks")),
        Claim("Each block's payload digest is bound to its block hash: a payload moved to another block with its "
              "digest is refused.",
              (f"{_KV_SNAP}::test_a_payload_swapped_between_two_blocks_with_its_digest_is_refused",)),
        Claim("Block hashes are re-derived from the token ids in the reading instance's scope (tenant, adapter "
              "fingerprint, salt); the manifest carries a fingerprint of the cache salt, never the salt, and a "
              "snapshot of another model, tokenizer, dtype, storage, block size or deployment is refused.",
              (f"{_KV_SNAP}::test_consistently_rewritten_tokens_fail_the_hash_rederivation",
               f"{_KV_SNAP}::test_a_snapshot_of_another_model_tokenizer_dtype_storage_block_size_or_salt_is_refused")),
        Claim("`snapshot_verify_share` of the blocks (at least one, with its ancestors) are recomputed and compared, "
              "drawn from `random.SystemRandom`, never seeded by anything in the files.",
              (f"{_LORA_SNAP}::test_the_verification_sample_is_drawn_by_the_reader_not_seeded_by_the_manifest",
               f"{_LORA_SNAP}::test_a_snapshot_rewritten_with_other_weights_is_rejected_by_recomputation")),
        Claim("In trust mode every manifest carries an HMAC-SHA256 under a key derived from the deployment secret; a "
              "manifest without it, with a wrong one or changed after signing is refused (`mac`), and an open-mode "
              "instance refuses a signed one.",
              (f"{_KV_SNAP}::test_trust_mode_manifests_carry_a_mac_that_a_writer_without_the_key_cannot_make",
               f"{_LORA_SNAP}::"
               "test_trust_mode_snapshots_are_signed_and_a_manifest_without_the_deployment_s_mac_is_refused")),
        Claim("A shared tier in open mode without `control_dir` (where `deployment.salt` keys its Redis keys and "
              "MACs) is refused at load.",
              ("tests/unit/triton/test_shared_tier_keys.py",)),
        Claim("A snapshot read into numpy arrays (the simulated engine's, which loads no torch) gets every check a "
              "torch reader makes: the same block digests, dtypes, shapes and finiteness.",
              ("tests/unit/kv/test_arrays.py::test_a_numpy_snapshot_with_a_non_finite_value_is_refused",
               "tests/unit/kv/test_arrays.py::test_a_block_digest_depends_on_dtype_shape_and_values_not_on_the_library")),
    )),
    Area("The model folder's tokenizer and chat template", "bounds-on-inputs", (
        Claim("A chat template renders in jinja2's `ImmutableSandboxedEnvironment` (jinja2 >= 3.1.6): it cannot read "
              "underscore attributes, change its inputs or store underscore names on a `namespace`.",
              ("tests/unit/common/test_tokenizer.py::test_a_template_cannot_reach_python_internals",)),
        Claim("Tokenizer files are bounded (`tokenizer.json` 256 MiB, config and template files 16 MiB each) and "
              "checked before they are read; a missing, oversized or malformed file stops the start with an error "
              "naming the file.",
              ("tests/unit/common/test_tokenizer.py::test_an_oversized_tokenizer_file_is_refused_before_it_is_read",
               "tests/unit/common/test_tokenizer.py::test_an_unreadable_folder_is_an_asset_error")),
    )),
    Area("The shared tier (Redis) slow, down or under a synchronized expiry", "bounds-on-inputs", (
        Claim("Every call ends within `redis_timeout_ms`: a Redis that accepts connections but never answers gives a "
              "miss, not a hang, and the circuit then skips Redis until `redis_retry_after_s`; an outage costs no "
              "request and ends by itself.",
              (f"{_REDIS}::test_a_stopped_redis_never_hangs_a_call",
               f"{_REDIS}::test_outage_degrades_to_local_and_compute_then_recovers",
               f"{_REDIS}::test_starts_with_redis_down")),
        Claim("One instance holds at most `redis_max_connections` connections; a call that finds none free within "
              "`redis_pool_timeout_ms` is a miss and leaves the circuit closed.",
              (f"{_REDIS}::test_pool_is_bounded_and_a_full_pool_is_a_miss",
               f"{_REDIS}::test_many_threads_share_at_most_max_connections")),
        Claim("A warm-up's keys expiring at once are recomputed once per key, not once per instance (48 keys, 8 "
              "instances asking at the same moment: 48 computations).",
              (f"{_REDIS}::test_a_warm_up_expiring_at_once_is_recomputed_once_per_key",)),
        Claim("`redis_ttl_jitter` spreads the expiry of keys written together over `ttl_s * (1 +- jitter)`, no 1% "
              "slice of the TTL holding more than an eighth of them.",
              (f"{_REDIS}::test_ttl_jitter_spreads_the_expiry_of_a_warm_up",)),
        Claim("A dead lock holder, or anyone with write access to Redis holding a key's lock, delays a request by at "
              "most `redis_lock_wait_ms`; a holder whose lock expired never frees another's lock, and a failed "
              "computation releases its lock.",
              (f"{_REDIS}::test_a_dead_lock_holder_delays_a_request_by_lock_wait_ms_at_most",
               f"{_REDIS}::test_a_lock_that_expired_is_never_released_by_its_old_holder",
               f"{_REDIS}::test_a_failed_compute_releases_the_lock")),
    )),
    Area("The sidecar", "ports-what-each-part-listens-on-and-who-may-reach-it", (
        Claim("The sidecar's `/status`, `/metrics` and `/ready` name no plan id (a canary verdict's reason names "
              "none, and a plan id inside an error's text is written `<plan>`) and no tenant; the log names both.",
              ("tests/unit/sidecar/test_monitor.py::test_no_public_endpoint_names_a_plan_id",
               "tests/unit/sidecar/canary/test_tenants.py::"
               "test_the_public_status_names_no_plan_and_no_tenant_while_the_log_names_both")),
        Claim("One tenant's traffic is bounded in what it decides for the canary: tenant by tenant, only tenants "
              "seen in both windows, none weighed above the third busiest, so neither a flood of warm requests "
              "saves a bad plan nor a few cold ones roll back a good one.",
              ("tests/unit/sidecar/canary/test_tenants.py",)),
        Claim("A canary verdict needs breadth: each tested measure leaves out the tenant that moved most each way "
              "(from three tenants on), so no single tenant, weighing 1/10 of a trial or up to the 1/3 the weight "
              "cap allows, rolls back a good plan or gets a bad one promoted, on one instance or either side of a "
              "whole replica.",
              ("tests/unit/sidecar/canary/test_judge.py::test_one_tenant_cannot_roll_back_a_good_plan_on_a_whole_replica",
               "tests/unit/sidecar/canary/test_judge.py::"
               "test_one_tenant_cannot_get_a_bad_plan_promoted_on_a_whole_replica",
               "tests/unit/sidecar/canary/test_judge.py::"
               "test_one_tenant_cannot_steer_a_trial_on_one_instance_either_way")),
        Claim("The sidecar's HTTP server serves a fixed pool of connections with a deadline on every read and write: "
              "40 half-sent requests hold no thread more, are closed at their deadline, and `/live` is answered "
              "meanwhile.",
              ("tests/unit/sidecar/test_monitor.py::"
               "test_half_sent_requests_hold_no_more_threads_than_the_pool_and_are_dropped_at_their_deadline",)),
        Claim("The sidecar reloads a model whose Python backend stub exited or was stopped, once per dead stub; when "
              "it is a decoupled model's (lora_adapter) it restarts tritonserver (`on_stub_death` `restart`), so a "
              "stream in flight ends with an error instead of waiting for the client's deadline.",
              ("tests/unit/sidecar/test_stubs.py", "tests/unit/sidecar/test_stub_death.py",
               "tests/integration/test_sidecar.py::"
               "test_a_stream_in_flight_on_a_killed_lora_adapter_stub_ends_with_an_error_instead_of_waiting_for_its_deadline")),
        Claim("Only a crashed, killed or stopped stub is a death: a stub Triton finalized (exit status 0, at an "
              "unload or after a model's config auto-complete) and the auto-complete stub itself never reload a "
              "model nor restart tritonserver.",
              ("tests/unit/sidecar/test_stubs.py::test_a_stub_that_triton_finalized_is_no_death",
               "tests/unit/sidecar/test_stubs.py::test_the_auto_complete_stub_is_not_watched")),
        Claim("A replica name, set or the host's, is one safe path component (never `.`, `..` or a `/`), checked "
              "where it enters; what a replica gone for `stale_writer_prune_s` left on the shared volumes is "
              "removed by the sidecars, never a live replica's.",
              ("tests/unit/common/test_names.py", "tests/unit/sidecar/test_prune.py")),
    )),
    Area("The OpenAI front", "ports-what-each-part-listens-on-and-who-may-reach-it", (
        Claim("In trust mode a request's `Authorization: Bearer <key>` names its tenant (SHA-256 compared with every "
              "hash of the keys file in constant time); a missing, malformed, oversized or wrong key gets one and "
              "the same 401, and neither `X-Tenant-Id` nor `user` can choose a tenant.",
              ("tests/unit/front/test_auth.py",
               f"{_TRUST_IT}::test_the_openai_front_takes_the_tenant_from_the_bearer_key")),
        Claim("A failure on the server's side (503, 504, 500) is answered with a fixed message: tritonserver's own "
              "text, and the sidecar's reason for not ready, go to the front's log only.",
              ("tests/unit/front/test_errors.py::test_tritonservers_text_of_a_failure_on_its_side_does_not_reach_the_client",
               "tests/unit/front/engine/test_triton_engine.py", "tests/unit/front/engine/test_protocol.py")),
        Claim("A request head that never ends is answered 408 and its connection closed (`head_timeout_s`).",
              (f"{_FRONT_HTTP}::test_a_head_that_never_ends_is_answered_408_and_its_connection_closed",)),
        Claim("Connections beyond `max_connections` are answered 503 at once, and those within keep working.",
              (f"{_FRONT_HTTP}::test_connections_beyond_the_bound_are_answered_503_at_once_and_those_within_keep_working",)),
        Claim("48 kinds of bad request sent to a front over a real tritonserver each get a clear error, and the front "
              "serves afterwards.",
              ("tests/integration/test_front.py::test_bad_requests_get_clear_errors_and_the_front_serves_after_them",)),
        Claim("In trust mode the front's `/health` and `/metrics` name no adapter to a caller without a tenant key.",
              ("tests/unit/front/routers/test_models.py::"
               "test_in_trust_mode_health_and_metrics_name_no_adapter_to_a_caller_without_a_key",)),
    )),
    Area("smg's gRPC worker protocol", "ports-what-each-part-listens-on-and-who-may-reach-it", (
        Claim("In trust mode the front refuses to start gRPC worker listeners (smg passes no tenant identity to a gRPC "
              "worker), with a ConfigError saying why, and `/grpc-workers` answers 404.",
              (f"{_GRPC}/test_servicer.py::test_trust_mode_refuses_the_listeners_and_the_ports_must_fit",
               f"{_GRPC_IT}::test_trust_mode_refuses_the_listeners",
               f"{_GRPC}/test_servicer.py::test_grpc_workers_is_404_without_listeners")),
        Claim("Every gRPC Generate is bounded (prompt tokens, token ids inside the vocabulary, stop strings, request "
              "id) and what the project does not do is refused with INVALID_ARGUMENT and what to change, never "
              "dropped; a failure on the server's side gives a fixed message and tritonserver's text goes to the log.",
              (f"{_GRPC}/test_sampling.py::test_what_the_project_does_not_do_is_refused_with_what_to_change",
               f"{_GRPC}/test_sampling.py::test_the_request_itself_is_bounded",
               f"{_GRPC_IT}::test_generate_refuses_what_the_project_does_not_do",
               f"{_GRPC}/test_servicer.py::test_engine_errors_keep_their_kind_and_server_side_text_stays_in_the_log")),
        Claim("HealthCheck fails the call unless the replica is ready and the model live (smg registers on the call's "
              "success); readiness, liveness and the per-tenant bound are checked before anything reaches "
              "tritonserver; smg's Abort or a cancelled call frees the sequence in lora_adapter.",
              (f"{_GRPC_IT}::test_health_fails_while_the_replica_is_not_ready",
               f"{_GRPC}/test_servicer.py::test_health_model_and_server_info",
               f"{_GRPC}/test_servicer.py::"
               "test_not_ready_not_live_and_over_the_tenant_bound_are_refused_before_the_engine",
               f"{_GRPC_IT}::test_a_client_that_leaves_mid_stream_frees_the_sequence",
               f"{_GRPC_IT}::test_abort_ends_a_running_generation_by_its_request_id",
               f"{_GRPC}/test_servicer.py::test_abort_and_a_cancelled_call_end_the_generation_and_forget_its_id")),
        Claim("At most `grpc_worker_models` listeners exist and a retired adapter's is closed; the KV event relay "
              "keeps the instance's final status, serves one instance per replica and ends the instance's call when "
              "the subscriber leaves; the tokenizer bundle reads regular files only, size-bounded.",
              (f"{_GRPC}/test_listeners.py::test_adapters_get_listeners_while_live_within_the_bound",
               f"{_GRPC}/test_slots.py::test_never_more_than_the_bound_and_a_freed_slot_goes_to_a_newcomer",
               f"{_GRPC}/test_kv_proxy.py::test_the_instances_final_status_and_details_reach_the_subscriber",
               f"{_GRPC}/test_kv_proxy.py::test_no_folder_several_sockets_or_none_yet",
               f"{_GRPC}/test_kv_proxy.py::test_a_subscriber_that_leaves_ends_the_instances_call",
               f"{_GRPC}/test_tokenizer_bundle.py::test_a_folder_without_a_tokenizer_or_with_a_fifo_is_refused")),
    )),
    Area("The fleet on gRPC workers", "ports-what-each-part-listens-on-and-who-may-reach-it", (
        Claim("The fleet refuses `worker_protocol grpc` in trust mode (smg 1.13 passes no tenant identity to a gRPC "
              "worker); the router's control key is given without tenant trust (`control_key_file`), read from its "
              "file by the router and every join (on no command line), and a local gRPC fleet makes an owner-only "
              "key per run.",
              ("tests/unit/fleet/test_grpc_workers.py::"
               "test_http_is_the_default_and_grpc_is_refused_with_trust_mode_citing_the_missing_tenant_identity",
               f"{_CONTROL_KEY}::test_the_control_key_is_given_without_trust_mode_and_trust_mode_stays_refused_over_grpc",
               f"{_CONTROL_KEY}::test_the_router_and_join_commands_read_the_key_from_its_file_and_no_command_line_carries_it",
               f"{_CONTROL_KEY}::test_a_grpc_fleet_makes_its_routers_key_once_per_run_owner_only")),
        Claim("In the gRPC fleet the router's worker API answers 401 to any `POST/GET/DELETE /workers` without the "
              "fleet's control key, while the fleet registers every listener with it and serves through the router.",
              ("tests/integration/test_fleet_grpc.py::test_the_routers_worker_api_answers_only_the_fleets_control_key",
               f"{_CONTROL_KEY}::test_over_grpc_the_routers_worker_api_refuses_a_caller_without_the_control_key")),
        Claim("The shipped gRPC variants give the deployment's `router_control.key` to the router and every join; the "
              "listeners are reachable by the router alone (compose: an internal network of the router and the "
              "replicas; Kubernetes: a NetworkPolicy admitting 9100-9115 from the router's pods only); the shipped "
              "`docker-compose.yml` stays trust mode on HTTP.",
              ("tests/unit/test_deploy_grpc.py::"
               "test_both_grpc_variants_put_the_routers_worker_api_behind_the_deployments_control_key",
               "tests/unit/test_deploy_grpc.py::test_the_overlays_replicas_listen_where_only_the_router_may_connect",
               "tests/unit/test_deploy_grpc.py::"
               "test_compose_grpc_listeners_are_on_an_internal_network_only_the_router_and_the_replicas_join")),
    )),
    Area("The benchmarks' peers (vLLM, llama.cpp)", "ports-what-each-part-listens-on-and-who-may-reach-it", (
        Claim("`bench peer` and `bench race` start vLLM and llama.cpp's `llama-server` on the loopback only; "
              "llama.cpp's source comes out of its sdist as regular files of its vendored tree (no link, nothing "
              "outside the target folder), and its GGUF converter names only the exact GPT-2 byte-level "
              "pre-tokenizer (any other unknown tokenizer stays refused).",
              ("tests/unit/sim/test_peer.py::"
               "test_vllm_runs_the_same_model_with_prefix_caching_and_every_adapter_folder_at_its_rank",
               "tests/unit/sim/test_peer_llamacpp.py::"
               "test_llama_server_loads_every_adapter_unapplied_with_a_2048_token_slot_per_stream_and_one_thread",
               "tests/unit/sim/test_peer_llamacpp.py::"
               "test_only_the_vendored_tree_and_its_commit_come_out_of_the_sdist_and_never_a_link",
               "tests/unit/sim/test_peer_llamacpp.py::"
               "test_the_demo_tokenizer_is_named_gpt2_and_any_other_pre_tokenizer_stays_unknown")),
    )),
    Area("Triton itself", "triton-itself", (
        Claim("The image is built on tritonserver 25.07 or later, the release with the fixes for "
              "CVE-2025-23310/23311 and CVE-2025-23319/23320/23334.",
              ("tests/unit/test_deploy_triton.py::test_the_image_is_built_on_a_triton_release_with_the_august_2025_fixes",)),
        Claim("In the replica as compose starts it, tritonserver's HTTP and gRPC listen on the loopback only; "
              "compose publishes no Triton port and Kubernetes' Service, NetworkPolicy and container ports open "
              "neither 8000 nor 8001.",
              ("tests/integration/test_triton_surface.py::test_tritonserver_listens_on_the_replicas_loopback_only",
               "tests/unit/test_deploy_triton.py::"
               "test_compose_publishes_no_triton_port_and_binds_them_to_the_replicas_loopback",
               "tests/unit/test_deploy_triton.py::test_kubernetes_opens_no_triton_port")),
        Claim("One request whose body is a million one-byte chunks, sent to every port that replica publishes, "
              "never reaches tritonserver 2.51 (which it crashes): the same process serves a real request after it.",
              ("tests/integration/test_triton_surface.py::"
               "test_a_million_one_byte_chunks_through_every_published_port_never_reach_tritonserver",)),
        Claim("Every tritonserver the project starts restricts the shared-memory, logging, trace, statistics and "
              "model-repository APIs to its per-run key, over HTTP (403) and gRPC (UNAVAILABLE), and they work "
              "with it.",
              ("tests/integration/test_triton_surface.py::test_the_restricted_apis_answer_the_per_run_key_only_over_http",
               "tests/integration/test_triton_surface.py::test_the_restricted_apis_answer_the_per_run_key_only_over_grpc",
               "tests/unit/server/test_server_command.py::"
               "test_sidecar_mode_loads_every_model_explicitly_and_restricts_every_admin_api",
               "tests/unit/server/test_server_command.py::"
               "test_default_mode_has_no_model_control_and_still_restricts_the_admin_apis")),
        Claim("The opt-in direct-access proxy passes only inference, generate, health and a model's readiness and "
              "metadata (HTTP) and six gRPC methods, caps bodies and re-frames a chunked one.",
              ("tests/unit/test_deploy_triton.py::test_the_direct_access_proxy_passes_only_inference_and_health",
               "tests/unit/test_deploy_triton.py::"
               "test_the_direct_access_proxy_is_an_opt_in_in_the_replicas_network_namespace",
               "tests/integration/test_triton_surface.py::test_the_direct_access_proxy_passes_inference_and_health_only")),
    )),
    Area("The shipped deployment", "ports-what-each-part-listens-on-and-who-may-reach-it", (
        Claim("The router's worker API is not reachable from outside: compose publishes the nginx gateway and "
              "Kubernetes an Ingress, each passing exactly the served routes (`POST /v1/chat/completions` and "
              "`/v1/completions` to the router, `GET /v1/models` to a replica's front) and hiding smg's "
              "`x-smg-routed-worker-id`; a NetworkPolicy guards the router pods.",
              (f"{_DEPLOY}::test_the_routers_worker_api_is_not_reachable_from_outside",
               f"{_DEPLOY}::test_the_gateway_and_the_ingress_pass_exactly_the_served_routes")),
        Claim("The gateway's nginx.conf, run by a real nginx in front of a trust-mode fleet, serves generation with a "
              "tenant key and names no replica in its headers, asks a key for `/v1/models`, answers 404 to the "
              "worker API, conversations, responses, the router's metrics and every other path, and re-frames a "
              "body of a million one-byte chunks, which is refused while the fleet serves on.",
              ("tests/integration/test_fleet_trust.py::"
               "test_the_gateway_as_shipped_passes_only_the_served_routes_to_the_trust_mode_fleet",)),
        Claim("The router keeps no conversation or response store (`--history-backend none`): what a client posts "
              "there cannot be read back; it refuses a body larger than the front's `max_body_bytes` (413, from its "
              "declared length), and `/v1/models` where the gateway sends it answers only a tenant key.",
              ("tests/unit/fleet/test_router.py::test_the_router_keeps_no_history_and_refuses_a_body_the_front_would",
               "tests/integration/test_fleet_trust.py::"
               "test_the_router_stores_no_conversation_and_its_model_list_asks_a_key_where_the_gateway_sends_it")),
        Claim("In trust mode the router keeps no state built from requests' text (`trust_policy`): tenant B's "
              "copies of tenant A's prompt land on A's replica no more often than B's fresh prompts do.",
              ("tests/unit/fleet/test_router.py::test_in_trust_mode_the_router_never_routes_on_the_requests_text",
               "tests/integration/test_fleet_trust.py::"
               "test_another_tenants_copy_of_a_prompt_does_not_follow_where_the_first_tenant_sent_it")),
        Claim("The router's control-plane key is on no process's command line: a launcher reads it from the "
              "secrets folder and hands it to smg in the same process; without the file it exits with one line "
              "naming it.",
              ("tests/unit/fleet/test_router.py::test_the_routers_control_key_is_on_no_command_line",
               "tests/unit/fleet/test_router.py::test_every_deployment_launches_the_router_with_one_command_line",
               "tests/unit/fleet/test_router.py::test_the_launcher_without_the_key_file_exits_with_one_line_naming_it")),
        Claim("Against a real smg in trust mode, the worker API refuses a caller without the control-plane key.",
              ("tests/unit/fleet/test_router.py::test_in_trust_mode_the_worker_api_refuses_a_caller_without_the_control_key",)),
        Claim("compose, Kubernetes and `warmup_tools fleet --secrets-dir` take the trust-mode file names and "
              "variables from one definition (`warmup_tools/common/deployment.py`) and the router's command line "
              "from one function (`fleet/router.py::smg_argv`).",
              (f"{_DEPLOY}::test_the_shipped_fleets_run_trust_mode_from_one_definition_of_the_secrets",
               f"{_DEPLOY}::test_the_routers_of_compose_and_kubernetes_run_the_local_fleets_command_line")),
        Claim("A fleet started as compose starts it routes a tenant's request with its key and serves it warm, "
              "answers 401 to a wrong key, refuses an anonymous or tenant-keyed `POST`, `GET` and "
              "`DELETE /workers`, and takes requests on a replica killed and started again.",
              ("tests/integration/test_fleet_trust.py",)),
        Claim("compose runs trust mode with secrets a one-shot service generates once (0700 folder, 0600 files); no "
              "password is in the shipped files and none has a default; only the inference ports are published "
              "beyond the loopback, and every long-running service restarts unless stopped.",
              (f"{_DEPLOY}::test_compose_runs_the_sidecar_in_trust_mode_with_generated_secrets",
               f"{_DEPLOY}::test_no_default_password_anywhere_in_the_shipped_files",
               f"{_DEPLOY}::test_compose_publishes_only_the_inference_ports_beyond_the_loopback_and_restarts_what_exits",
               f"{_DEPLOY}::test_deploy_secrets_makes_owner_only_files_once_and_every_deployment_its_own")),
        Claim("`deploy/k8s/` runs trust mode from the Secret `triton-warmup-trust` (0400, read-only; the pod does not "
              "start without it), takes the Redis URL only from a Secret, and its Service exposes inference only; "
              "the image defaults to trust mode (without the files its models refuse to load).",
              (f"{_DEPLOY}::test_the_pod_runs_trust_mode_from_a_secret_and_the_service_exposes_inference_only",
               f"{_DEPLOY}::test_the_image_defaults_to_trust_mode")),
        Claim("compose and Kubernetes run the replicas under stable names (compose `hostname`, a StatefulSet) with "
              "one sidecar command.",
              (f"{_DEPLOY}::test_the_replicas_of_compose_and_kubernetes_run_one_sidecar_command_under_stable_names",)),
    )),
)


def markdown() -> str:
    claims = [claim for area in AREAS for claim in area.claims]
    tests = {test for claim in claims for test in claim.tests}
    lines = [
        "# Security claims and their tests",
        "",
        "<!-- Generated by `python scripts/security_claims.py > docs/security-claims.md`; edit the script, not this"
        " file. -->",
        "",
        f"What [SECURITY.md](../SECURITY.md) states in short, written out claim by claim, each with the tests that "
        f"check it: {len(claims)} claims, {len(tests)} tests. A test is `path::function` (a parametrized test "
        "counts once) or a whole test file. `tests/unit/test_security_claims.py` checks that every test named here "
        "exists and that this page is the script's output.",
    ]
    for area in AREAS:
        lines += ["", f"## {area.title}", "", f"Stated in short in [SECURITY.md](../SECURITY.md#{area.section}).", ""]
        for claim in area.claims:
            lines.append(f"- {claim.text}")
            lines += [f"  - `{test}`" for test in claim.tests]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
