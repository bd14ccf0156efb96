"""Settings every test shares."""

from __future__ import annotations

from hypothesis import settings

# Tests never assert wall-clock times: Hypothesis' per-example deadline is one,
# and on a loaded 2-core machine it fails examples that are merely slow.
settings.register_profile("tap-upr-gateway", deadline=None)
settings.load_profile("tap-upr-gateway")
