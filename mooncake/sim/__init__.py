"""``mooncake sim``: a discrete-event cluster simulator over the real scheduler."""
