"""The whole cluster on one machine: its role processes (cluster) and their supervision."""
