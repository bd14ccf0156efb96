"""Pure translation between TAP and UPR events, one vbucket at a time."""
