try:
    from gateway.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while importing: nothing started yet
    raise SystemExit(130) from None

raise SystemExit(main())
