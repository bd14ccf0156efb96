"""``python -m gateway.verify LEFT RIGHT``; with spark-submit: ``spark-submit -m ...`` or
``spark-submit gateway/verify/__main__.py LEFT RIGHT`` (ship the package with --py-files)."""

from gateway.verify.command import main

raise SystemExit(main())
