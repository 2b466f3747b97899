"""The run's settings: the config read once, section by section, into frozen
values (`runspec.read`), and built into the RunSpec the loop reads
(`runspec.build`)."""
