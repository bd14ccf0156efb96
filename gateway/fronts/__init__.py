"""The two fronts: TAP clients served from UPR nodes (``tap``), UPR consumers from TAP (``upr``)."""
