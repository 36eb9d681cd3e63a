"""The sidecar's model engine: load, render, tokenize through the shared lookup, record outputs."""
