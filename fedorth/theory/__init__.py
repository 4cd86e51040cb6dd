"""Theory toys of the papers: small problems with closed-form stationarity measures."""
