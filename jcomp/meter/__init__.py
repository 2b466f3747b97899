"""The byte meter: the bytes a compiled JAX program sends, per mesh axis and per
collective, read from its HLO text (`wire`; `hlo` reads the text itself)."""
