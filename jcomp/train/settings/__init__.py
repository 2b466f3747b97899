"""The run's settings: the config read once, checked, into frozen values."""
