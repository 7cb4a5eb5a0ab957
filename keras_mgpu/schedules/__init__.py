"""Learning-rate schedules and scaling rules."""
