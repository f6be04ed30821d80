"""NAT traversal for the chunk path (docs/nat.md): the learner's reflector classifies each
worker (``reflect``), links to punchable parents are opened by TCP simultaneous open
(``punch``) and carry the unchanged zmq sessions (``tunnel``); ``links`` decides per link."""
