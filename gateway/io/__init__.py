"""I/O shared by every listener and dialer here: what moves bytes, not what they mean.

- ``connection``: the one connection type, for accepted and dialed sockets
  (framing, each stage's size and time limits, the batching writer, TLS
  dialing, and the client side of a command connection: requests, STAT,
  SASL PLAIN);
- ``listen``: accepting (TLS handshake, the connection limit) and serving
  each connection with ``connection.run_connection``;
- ``replies``: the memcached responses every role builds alike (a reply to a
  request, an error reply whose value says why, a STAT answer, a refusal
  seen out before the connection closes);
- ``door``: the command door every accepted connection passes through before
  it becomes a stream (SASL PLAIN, NOOP, VERSION, STAT), with a hook for each
  role's stream opcodes and commands;
- ``named``: open connections by name, where a newer namesake replaces the
  older one (the node's TAP and UPR connections, both fronts');
- ``upr_producer`` and ``upr_stream``: the trio side of a UPR producer
  connection and of one of its streams, the node's and the UPR front's alike
  (their rules are ``adapters.upr.producer_machine`` and ``stream_machine``).
"""
