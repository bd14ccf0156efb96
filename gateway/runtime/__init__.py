"""Process-wide runtime: logging, version, memory trimming, the trio loop and GC watch,
shutdown on signals."""
