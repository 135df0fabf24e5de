"""smg's gRPC worker protocol (the ``VllmEngine`` service of ``smg-grpc-proto``) served by the OpenAI front: one
listener per model, backed by the front's Triton engine (docs/fleet.md, "smg's gRPC worker protocol").

:mod:`.sampling` maps a ``GenerateRequest`` onto the generate request's wire names and refuses what the project
does not do; :mod:`.slots` gives each live model a stable port; :mod:`.tokenizer_bundle` zips the LM tokenizer for
``GetTokenizer``; :mod:`.kv_proxy` relays ``SubscribeKvEvents`` from the lora_adapter instance's own event socket;
:mod:`.servicer` answers the RPCs of one model; :mod:`.listeners` starts, follows and stops the listeners.
"""
