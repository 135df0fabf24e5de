"""The engine interface the routers use (:mod:`.engine`) and its one implementation on tritonserver
(:mod:`.triton_engine`)."""
