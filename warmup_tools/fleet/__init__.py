"""A fleet on one machine: N replicas (tritonserver, sidecar and OpenAI front each) behind the ``smg`` router,
a replica joining only once warm and leaving by draining (docs/fleet.md)."""
