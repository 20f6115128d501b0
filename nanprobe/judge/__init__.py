"""Judge a step's numbers against the run's own healthy stretch: divergence, precursor trends, update checks, data checks."""
