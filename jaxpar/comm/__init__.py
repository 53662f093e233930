"""Communication: all-reduce algorithms over ppermute, gradient bucket plans, hooks that reduce from inside the
backward pass, and what a collective costs (a model, and the compiled HLO's own count)."""
