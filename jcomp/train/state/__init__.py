"""The train state and its steps: restored or initialised, each phase's compiled step."""
