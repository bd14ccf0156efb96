"""The gateway: trio servers, upstream connections, journal, metrics and CLI."""
