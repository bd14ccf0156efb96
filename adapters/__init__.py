"""Sans-IO protocol code: framing, TAP and UPR codecs, translation.

Nothing below this package imports trio, sockets or clocks; time enters as a
``now`` argument where a state machine needs it.
"""
