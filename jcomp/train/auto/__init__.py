"""compression.auto: codecs chosen from a profile, by prediction or by trial."""
