"""The embedded reference node: an in-memory vbucket store served over memcached, TAP and UPR."""
