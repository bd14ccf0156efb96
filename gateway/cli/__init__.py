"""Entry points: the command line, its options and settings, start-up checks, and ``serve``."""
