"""The protocol between Shepherd and the agents on its machines: protocol buffers and the heartbeat signature.

The ``*_pb2`` modules are generated from the ``.proto`` files beside them by
``python -m proto.generate``; a test checks that they match.
"""
