"""A replica as a gRPC worker of the ``smg`` router: its KV events on smg's engine protocol (``smg-grpc-proto``'s
``SubscribeKvEvents``, :mod:`.kv_wire`)."""
