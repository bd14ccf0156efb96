"""``python -m gateway.tools.verify LEFT RIGHT``; with spark-submit: ``spark-submit -m ...`` or
``spark-submit gateway/tools/verify/__main__.py LEFT RIGHT`` (ship the package with --py-files)."""

from gateway.tools.verify.command import main

raise SystemExit(main())
